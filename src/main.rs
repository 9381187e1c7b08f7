//! The `pdctl` binary: all logic lives in the library; this only maps errors to exit codes.

fn main() -> std::process::ExitCode {
    pdctl::cli::main()
}
