//! Prints the env file the build script wrote for the CUDA toolkit pinstream was built with:
//! `CUDA_HOME`, `CUDA_PATH`, `NVCC`, `PATH`, `LD_LIBRARY_PATH`, ... for the build scripts of
//! crates that look for a toolkit themselves (cudarc, candle-core's `cuda` feature). Use it as
//!
//!     eval "$(cargo run -q --example toolkit_env)"
//!
//! or source the file it names on its first line. See "Sharing the toolkit" in the README.

fn main() {
    // Empty in a docs.rs build, which has no toolkit.
    let path = env!("PINSTREAM_TOOLKIT_ENV");
    let Ok(text) = std::fs::read_to_string(path) else {
        eprintln!("no toolkit env file at `{path}`: rebuild pinstream (cargo clean -p pinstream)");
        std::process::exit(1);
    };
    print!("# {path}\n{text}");
}
