//! What every example does with its result (shared by the examples, not an example itself).

use std::error::Error;
use std::process::ExitCode;

/// The exit status for an example's result: 0 on success, and also where the machine has no
/// usable CUDA device or driver (`pinstream::Error::NoDevice`), after a line that says so:
/// `no CUDA device: <error>`. Any other error is printed after the example's `name`, status 1.
pub fn exit_status(name: &str, result: Result<(), Box<dyn Error>>) -> ExitCode {
    let Err(e) = result else {
        return ExitCode::SUCCESS;
    };
    match e.downcast_ref::<pinstream::Error>() {
        // No driver, too old a driver, or no GPU: not this program's fault.
        Some(e) if e.is_no_device() => {
            eprintln!("no CUDA device: {e}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{name}: {e}");
            ExitCode::FAILURE
        }
    }
}
