//! Embeds the eBPF object built by `cargo xtask build`.
//!
//! The object is looked up at `$EPX_EBPF_OBJECT`, else at the path xtask writes it to. Without
//! one, the binary still builds (so `cargo test` works for the pure logic) but the agent refuses
//! to start and says how to build it properly.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=EPX_EBPF_OBJECT");
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let object = std::env::var_os("EPX_EBPF_OBJECT").map(PathBuf::from).unwrap_or_else(|| {
        manifest_dir.join("../target/bpf/bpfel-unknown-none/release/proxy-ebpf")
    });
    println!("cargo:rerun-if-changed={}", object.display());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("proxy-ebpf.o");
    match std::fs::read(&object) {
        Ok(bytes) => std::fs::write(&out, bytes).unwrap(),
        Err(_) => {
            println!("cargo:warning=no eBPF object at {}; run `cargo xtask build` for a working agent", object.display());
            std::fs::write(&out, []).unwrap();
        }
    }
}
