//! The `pdctl` binary: all logic lives in the library; this only maps errors to exit codes.

/// mimalloc instead of glibc's malloc: the proxy allocates and frees small buffers on
/// every request from several threads, where glibc's allocator spent about a tenth of the
/// proxy's CPU (docs/proxy.md, "CPU per request").
/// The `system-allocator` feature leaves glibc's in place for heap profilers.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    pdctl::cli::main()
}

/// Turns transparent huge pages off for the proxy and the sim, before anything is allocated.
///
/// mimalloc commits its arenas eagerly; where the kernel backs anonymous memory with huge
/// pages on first touch (`/sys/kernel/mm/transparent_hugepage/enabled` is `always`, as on
/// Debian and Ubuntu), every 2 MiB of an arena that holds one live object is 2 MiB resident:
/// an idle proxy held 8.7 MiB of anonymous memory instead of 1.3 (docs/proxy.md, "Memory").
/// Only for these two commands, which start no other programs: the flag is inherited, and
/// the supervisor's children are vLLM engines. It runs as a constructor (glibc passes
/// these the program's arguments) because the Rust runtime allocates before `main`, and
/// pages touched before the flag is set stay huge.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[used]
#[unsafe(link_section = ".init_array")]
static NO_HUGE_PAGES_FOR_SERVERS: extern "C" fn(
    std::ffi::c_int,
    *const *const std::ffi::c_char,
    *const *const std::ffi::c_char,
) = no_huge_pages_for_servers;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
extern "C" fn no_huge_pages_for_servers(
    argc: std::ffi::c_int,
    argv: *const *const std::ffi::c_char,
    _env: *const *const std::ffi::c_char,
) {
    if argc < 2 || argv.is_null() {
        return;
    }
    // SAFETY: glibc calls the executable's init_array functions with main's argc and argv,
    // so argv[1] is a NUL-terminated string; nothing here allocates.
    let command = unsafe { std::ffi::CStr::from_ptr(*argv.add(1)) };
    if matches!(command.to_bytes(), b"proxy" | b"sim") {
        let _ = nix::sys::prctl::set_thp_disable(true);
    }
}
