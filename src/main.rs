//! The `pdctl` binary: all logic lives in the library; this only maps errors to exit codes.

/// mimalloc instead of glibc's malloc: the proxy allocates and frees small buffers on
/// every request from several threads, where glibc's allocator spent about a tenth of the
/// proxy's CPU (docs/proxy.md, "CPU per request").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    pdctl::cli::main()
}
