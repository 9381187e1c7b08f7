//! The `pdctl` binary: all logic lives in the library; this only maps errors to exit codes.

/// mimalloc instead of glibc's malloc: the proxy allocates and frees small buffers on
/// every request from several threads, where glibc's allocator spent about a tenth of the
/// proxy's CPU (docs/proxy.md, "CPU per request").
/// The `system-allocator` feature leaves glibc's in place for heap profilers.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    no_huge_pages_for_servers();
    pdctl::cli::main()
}

/// Turns transparent huge pages off for the proxy and the sim, before they allocate.
///
/// mimalloc commits its arenas eagerly; where the kernel backs anonymous memory with huge
/// pages on first touch (`/sys/kernel/mm/transparent_hugepage/enabled` is `always`, as on
/// Debian and Ubuntu), every 2 MiB of an arena that holds one live object is 2 MiB resident:
/// an idle proxy held 8.7 MiB of anonymous memory instead of 1.3, and under 1000 streams
/// and after them far more than it used (docs/proxy.md, "Memory"). Only for these two
/// commands, which start no other programs: the flag is inherited, and the supervisor's
/// children are vLLM engines. The command is read from argv here because by the time the
/// arguments are parsed the allocator has already touched its first pages.
fn no_huge_pages_for_servers() {
    #[cfg(target_os = "linux")]
    {
        let command = std::env::args_os().nth(1);
        if matches!(command.as_deref().and_then(|c| c.to_str()), Some("proxy" | "sim")) {
            let _ = nix::sys::prctl::set_thp_disable(true);
        }
    }
}
