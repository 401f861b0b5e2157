fn main() {
    match pinstream::Device::count() {
        Ok(n) => println!("{n} devices"),
        Err(e) => {
            println!("{e}");
            std::process::exit(2)
        }
    }
}
