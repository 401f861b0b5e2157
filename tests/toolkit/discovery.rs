//! Toolkit discovery (the build script's logic): CPU trials, run everywhere.

#[path = "../../build/toolkit.rs"]
#[allow(dead_code)]
mod toolkit;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::common::{ensure, R};
use libtest_mimic::Trial;
use toolkit::Source;

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "discovery/";

/// The trials of this module, named `discovery/...`.
pub fn trials() -> Vec<Trial> {
    let t = |name: &str, f: fn() -> R| trial(PREFIX, name, f);
    vec![
        t(
            "toolkit/candidates_in_documented_order",
            candidates_in_documented_order,
        ),
        t(
            "toolkit/toolkit_at_checks_each_part",
            toolkit_at_checks_each_part,
        ),
        t(
            "toolkit/first_usable_candidate_wins",
            first_usable_candidate_wins,
        ),
        t(
            "toolkit/provisioned_dirs_and_target_dir",
            provisioned_dirs_and_target_dir,
        ),
        t("toolkit/cache_dir_order", cache_dir_order),
        t(
            "toolkit/provisioned_locations_cache_first",
            provisioned_locations_cache_first,
        ),
        t("toolkit/provision_tmp_names", provision_tmp_names),
        t("toolkit/no_provision_switch", no_provision_switch),
        t("toolkit/arch_list_parsing", arch_list_parsing),
        t(
            "toolkit/arch_selection_by_toolkit",
            arch_selection_by_toolkit,
        ),
        t("toolkit/cudart_version_and_gates", cudart_version_and_gates),
        t(
            "toolkit/env_file_and_link_metadata",
            env_file_and_link_metadata,
        ),
        t(
            "toolkit/failure_messages_say_what_to_do",
            failure_messages_say_what_to_do,
        ),
        t("toolkit/empty_variable_is_unset", empty_variable_is_unset),
    ]
}

/// A scratch folder unique to this trial, removed first if it exists.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pinstream-cpu-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn touch(path: &Path) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, b"x").expect("write");
}

/// A fake toolkit with the given library folder name ("lib64" or "lib").
fn fake_toolkit(root: &Path, lib: &str) {
    touch(&root.join("bin/nvcc"));
    touch(&root.join("include/cuda_runtime_api.h"));
    touch(&root.join(lib).join("libcudart_static.a"));
}

fn env_of(pairs: Vec<(&'static str, OsString)>) -> impl Fn(&str) -> Option<OsString> {
    move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
}

fn candidates_in_documented_order() -> R {
    let dir = scratch("order");
    let bin = dir.join("pathcuda/bin");
    touch(&bin.join("nvcc"));
    let path = std::env::join_paths([dir.join("nothing-here"), bin.clone()]).expect("join");
    let env = env_of(vec![
        ("CUDA_HOME", dir.join("home").into()),
        ("CUDA_PATH", dir.join("path").into()),
        ("PATH", path),
    ]);
    let provisioned = vec![dir.join("prov")];
    let c = toolkit::candidates(&env, &provisioned);
    let sources: Vec<Source> = c.iter().map(|(s, _)| *s).collect();
    ensure(
        sources
            == vec![
                Source::CudaHome,
                Source::CudaPath,
                Source::NvccOnPath,
                Source::UsrLocalCuda,
                Source::Provisioned,
            ],
        || format!("{sources:?}"),
    )?;
    ensure(c[2].1 == dir.join("pathcuda"), || {
        format!("nvcc on PATH root {:?}", c[2].1)
    })?;
    ensure(c[4].1 == dir.join("prov/nvidia/cu13"), || {
        format!("provisioned root {:?}", c[4].1)
    })?;
    // Empty variables are not candidates.
    let env = env_of(vec![("CUDA_HOME", OsString::new())]);
    let c = toolkit::candidates(&env, &[]);
    ensure(c.len() == 1 && c[0].0 == Source::UsrLocalCuda, || {
        format!("{c:?}")
    })
}

/// The env file sources in a POSIX shell and points every variable other crates' builds read at
/// the toolkit, quoting included; the `links` metadata names its parts.
fn env_file_and_link_metadata() -> R {
    let dir = scratch("env file");
    let root = dir.join("it's cu13");
    touch(&root.join("bin/nvcc"));
    touch(&root.join("include/cuda_runtime_api.h"));
    touch(&root.join("lib/libcudart_static.a"));
    let tk = toolkit::toolkit_at(Source::Provisioned, &root).map_err(|e| e.to_string())?;
    let file = dir.join(toolkit::ENV_FILE_NAME);
    std::fs::write(&file, toolkit::env_script(&tk, 13000)).expect("write");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(
            ". \"$1\" && printf '%s\\n' \"$CUDA_HOME\" \"$CUDA_PATH\" \"$CUDA_ROOT\" \"$NVCC\" \
             \"$CUDARC_CUDA_VERSION\" \"${PATH%%:*}\" \"${LD_LIBRARY_PATH%%:*}\" \"$CUDA_COMPUTE_CAP\"",
        )
        .arg("sh")
        .arg(&file)
        .env("PATH", "/usr/bin:/bin")
        .env("LD_LIBRARY_PATH", "/x")
        .env("CUDA_COMPUTE_CAP", "75")
        .output()
        .expect("sh");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    let r = root.display().to_string();
    let want = [
        r.clone(),
        r.clone(),
        r.clone(),
        format!("{r}/bin/nvcc"),
        "13000".into(),
        format!("{r}/bin"),
        format!("{r}/lib"),
        "75".into(), // a CUDA_COMPUTE_CAP the user set stays
    ];
    ensure(out.status.success() && lines == want, || {
        format!(
            "{:?}\n{text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let meta = toolkit::link_metadata(&tk, 13000, &file);
    let keys: Vec<&str> = meta.iter().map(|(k, _)| *k).collect();
    ensure(
        keys == ["root", "include", "lib", "nvcc", "version", "env"],
        || format!("{meta:?}"),
    )?;
    std::fs::create_dir_all(root.join("include/cccl")).expect("mkdir");
    let meta = toolkit::link_metadata(&tk, 13000, &file);
    ensure(
        meta.last().is_some_and(|(k, _)| *k == "cccl_include"),
        || format!("{meta:?}"),
    )
}

fn toolkit_at_checks_each_part() -> R {
    let dir = scratch("parts");
    let root = dir.join("cuda");
    let e = toolkit::toolkit_at(Source::CudaHome, &root).unwrap_err();
    ensure(e.contains("not a directory"), || e.clone())?;
    touch(&root.join("bin/nvcc"));
    let e = toolkit::toolkit_at(Source::CudaHome, &root).unwrap_err();
    ensure(e.contains("cuda_runtime_api.h"), || e.clone())?;
    touch(&root.join("include/cuda_runtime_api.h"));
    let e = toolkit::toolkit_at(Source::CudaHome, &root).unwrap_err();
    ensure(e.contains("libcudart_static.a"), || e.clone())?;
    touch(&root.join("lib/libcudart_static.a"));
    let tk = toolkit::toolkit_at(Source::CudaHome, &root).map_err(|e| e.to_string())?;
    ensure(
        tk.lib == root.join("lib") && tk.nvcc == root.join("bin/nvcc"),
        || format!("{tk:?}"),
    )?;
    // lib64 wins over lib, as in a regular toolkit.
    touch(&root.join("lib64/libcudart_static.a"));
    let tk = toolkit::toolkit_at(Source::CudaHome, &root).map_err(|e| e.to_string())?;
    ensure(tk.lib == root.join("lib64"), || format!("{tk:?}"))?;
    ensure(tk.include == root.join("include"), || format!("{tk:?}"))?;
    // Debian's nvidia-cuda-toolkit: CUDA_HOME=/usr, the library in the multiarch folder.
    let usr = dir.join("usr");
    touch(&usr.join("bin/nvcc"));
    touch(&usr.join("include/cuda_runtime_api.h"));
    touch(&usr.join("lib/x86_64-linux-gnu/libcudart_static.a"));
    let tk = toolkit::toolkit_at(Source::CudaHome, &usr).map_err(|e| e.to_string())?;
    ensure(tk.lib == usr.join("lib/x86_64-linux-gnu"), || {
        format!("{tk:?}")
    })
}

fn first_usable_candidate_wins() -> R {
    let dir = scratch("first");
    let broken = dir.join("broken");
    touch(&broken.join("bin/nvcc"));
    let good_a = dir.join("a");
    let good_b = dir.join("b");
    fake_toolkit(&good_a, "lib64");
    fake_toolkit(&good_b, "lib");
    let c = vec![
        (Source::CudaHome, broken.clone()),
        (Source::UsrLocalCuda, good_a.clone()),
        (Source::Provisioned, good_b),
    ];
    let tk = toolkit::find_toolkit(&c).map_err(|e| e.join("; "))?;
    ensure(
        tk.root == good_a && tk.source == Source::UsrLocalCuda,
        || format!("{tk:?}"),
    )?;
    let why = toolkit::find_toolkit(&c[..1]).unwrap_err();
    ensure(
        why.len() == 1 && why[0].contains("cuda_runtime_api.h"),
        || format!("{why:?}"),
    )
}

fn provisioned_dirs_and_target_dir() -> R {
    let dir = scratch("target");
    // target/ (with CACHEDIR.TAG) / tests/nested (a nested target dir with its own) / debug/build/pkg-hash/out
    let target = dir.join("target");
    let nested = target.join("tests/nested");
    let out = nested.join("debug/build/pinstream-abc/out");
    std::fs::create_dir_all(&out).expect("mkdir");
    touch(&target.join("CACHEDIR.TAG"));
    touch(&nested.join("CACHEDIR.TAG"));
    let td = toolkit::target_dir(&out);
    ensure(td == target, || format!("outermost target dir: {td:?}"))?;
    ensure(
        toolkit::provisioned_dirs(&out, toolkit::CUDA_DIR_NAME).is_empty(),
        || "none yet".into(),
    )?;
    std::fs::create_dir_all(target.join(toolkit::CUDA_DIR_NAME)).expect("mkdir");
    std::fs::create_dir_all(nested.join(toolkit::CUDA_DIR_NAME)).expect("mkdir");
    let found = toolkit::provisioned_dirs(&out, toolkit::CUDA_DIR_NAME);
    ensure(
        found
            == vec![
                target.join(toolkit::CUDA_DIR_NAME),
                nested.join(toolkit::CUDA_DIR_NAME),
            ],
        || format!("{found:?}"),
    )?;
    // Without any CACHEDIR.TAG: four levels above OUT_DIR.
    let plain = dir.join("t2/release/build/p-1/out");
    std::fs::create_dir_all(&plain).expect("mkdir");
    let td = toolkit::target_dir(&plain);
    ensure(td == dir.join("t2"), || format!("{td:?}"))
}

fn cache_dir_order() -> R {
    let all = env_of(vec![
        ("PINSTREAM_CACHE", "/c/pin".into()),
        ("XDG_CACHE_HOME", "/c/xdg".into()),
        ("HOME", "/home/u".into()),
    ]);
    let got = toolkit::cache_dir(&all);
    ensure(got == Some(PathBuf::from("/c/pin")), || {
        format!("PINSTREAM_CACHE first: {got:?}")
    })?;
    let xdg = env_of(vec![
        ("PINSTREAM_CACHE", OsString::new()),
        ("XDG_CACHE_HOME", "/c/xdg".into()),
        ("HOME", "/home/u".into()),
    ]);
    let got = toolkit::cache_dir(&xdg);
    ensure(got == Some(PathBuf::from("/c/xdg/pinstream")), || {
        format!("XDG_CACHE_HOME second: {got:?}")
    })?;
    // A relative XDG_CACHE_HOME is ignored, as the XDG spec says.
    let rel = env_of(vec![
        ("XDG_CACHE_HOME", "rel/cache".into()),
        ("HOME", "/home/u".into()),
    ]);
    let got = toolkit::cache_dir(&rel);
    ensure(
        got == Some(PathBuf::from("/home/u/.cache/pinstream")),
        || format!("HOME last: {got:?}"),
    )?;
    let none = env_of(vec![("HOME", OsString::new())]);
    let got = toolkit::cache_dir(&none);
    ensure(got.is_none(), || format!("nothing set: {got:?}"))
}

fn provisioned_locations_cache_first() -> R {
    let dir = scratch("cache");
    let cache = dir.join("cache");
    let target = dir.join("target");
    let out = target.join("debug/build/pinstream-abc/out");
    std::fs::create_dir_all(&out).expect("mkdir");
    touch(&target.join("CACHEDIR.TAG"));
    let (cname, tname) = (toolkit::CACHE_CUDA_NAME, toolkit::CUDA_DIR_NAME);
    // Nothing provisioned yet: nothing found; new copies go to the cache, or without one to
    // the target dir as before.
    let found = toolkit::provisioned_locations(Some(&cache), cname, &out, tname);
    ensure(found.is_empty(), || format!("{found:?}"))?;
    let dest = toolkit::provision_dest(Some(&cache), cname, &out, tname);
    ensure(dest == cache.join(cname), || format!("{dest:?}"))?;
    let dest = toolkit::provision_dest(None, cname, &out, tname);
    ensure(dest == target.join(tname), || format!("{dest:?}"))?;
    // A copy from before the cache, in the target dir, is still found (no new download) ...
    std::fs::create_dir_all(target.join(tname)).expect("mkdir");
    let found = toolkit::provisioned_locations(Some(&cache), cname, &out, tname);
    ensure(found == vec![target.join(tname)], || format!("{found:?}"))?;
    // ... and the cache's copy comes before it.
    std::fs::create_dir_all(cache.join(cname)).expect("mkdir");
    let found = toolkit::provisioned_locations(Some(&cache), cname, &out, tname);
    ensure(found == vec![cache.join(cname), target.join(tname)], || {
        format!("{found:?}")
    })?;
    let found = toolkit::provisioned_locations(None, cname, &out, tname);
    ensure(found == vec![target.join(tname)], || format!("{found:?}"))?;
    // They become toolkit candidates after every other place, in that order.
    let env = env_of(vec![]);
    let both = vec![cache.join(cname), target.join(tname)];
    let c = toolkit::candidates(&env, &both);
    let prov: Vec<&PathBuf> = c
        .iter()
        .filter(|(s, _)| *s == Source::Provisioned)
        .map(|(_, p)| p)
        .collect();
    ensure(
        prov == vec![
            &cache.join(cname).join(toolkit::PYPI_TOOLKIT_SUBDIR),
            &target.join(tname).join(toolkit::PYPI_TOOLKIT_SUBDIR),
        ] && c.last().map(|(s, _)| *s) == Some(Source::Provisioned),
        || format!("{c:?}"),
    )
}

fn provision_tmp_names() -> R {
    let dest = Path::new("/c/pinstream").join(toolkit::CACHE_CUDA_NAME);
    let tmp = toolkit::provision_tmp(&dest, 4242);
    ensure(
        tmp.parent() == dest.parent() && tmp.file_name().is_some(),
        || format!("{tmp:?} is not a sibling of {dest:?}"),
    )?;
    let name = tmp.file_name().and_then(|n| n.to_str()).ok_or("tmp name")?;
    ensure(name.starts_with('.'), || format!("{name} is not hidden"))?;
    ensure(
        toolkit::provision_tmp_pid(&dest, name) == Some(4242),
        || format!("{name}: pid not read back"),
    )?;
    for other in [
        toolkit::CACHE_CUDA_NAME,
        ".libclang-18.1.1.tmp-1",
        ".cuda-13.0.88.tmp-x",
        ".cuda-13.0.88.tmp-",
    ] {
        ensure(toolkit::provision_tmp_pid(&dest, other).is_none(), || {
            format!("{other} taken for a temporary folder")
        })?;
    }
    // Cache folders are keyed by the pinned versions: nvcc's, and CCCL's (added later).
    let pin = |i: usize| toolkit::CUDA_PINS[i].rsplit("==").next().ok_or("pin");
    let (nvcc_pin, cccl_pin) = (pin(0)?, pin(toolkit::CUDA_PINS.len() - 1)?);
    let want = format!("cuda-{nvcc_pin}-cccl-{cccl_pin}");
    ensure(
        toolkit::CACHE_CUDA_NAME == want && toolkit::CUDA_PINS.last().unwrap().contains("cccl"),
        || format!("{} vs {want}", toolkit::CACHE_CUDA_NAME),
    )?;
    let clang_pin = toolkit::LIBCLANG_PIN.rsplit("==").next().ok_or("pin")?;
    ensure(toolkit::CACHE_LIBCLANG_NAME.ends_with(clang_pin), || {
        format!("{} vs {clang_pin}", toolkit::CACHE_LIBCLANG_NAME)
    })?;
    // The warning says where it went and how to remove it.
    let w = toolkit::provisioned_warning("CUDA 13.0", &dest, true);
    for needle in ["/c/pinstream/cuda-13.0.88", "rm -rf", "PINSTREAM_CACHE"] {
        ensure(w.contains(needle), || format!("missing {needle:?} in {w}"))?;
    }
    let w = toolkit::provisioned_warning("CUDA 13.0", &dest, false);
    ensure(w.contains("cargo clean"), || w.clone())
}

fn no_provision_switch() -> R {
    for (v, want) in [
        (None, false),
        (Some(""), false),
        (Some("0"), false),
        (Some("false"), false),
        (Some("1"), true),
        (Some("yes"), true),
    ] {
        let got = toolkit::provisioning_disabled(v.map(OsString::from));
        ensure(got == want, || {
            format!("PINSTREAM_NO_PROVISION={v:?} gave {got}")
        })?;
    }
    Ok(())
}

fn arch_list_parsing() -> R {
    let a = toolkit::parse_archs("75, sm_86;compute_90 90a").map_err(|e| e.to_string())?;
    ensure(a == ["75", "86", "90", "90a"], || format!("{a:?}"))?;
    let a = toolkit::parse_archs("90,90").map_err(|e| e.to_string())?;
    ensure(a == ["90"], || format!("{a:?}"))?;
    for bad in ["", " , ", "sm_9", "hopper", "sm_90ab", "1000"] {
        ensure(toolkit::parse_archs(bad).is_err(), || {
            format!("{bad:?} accepted")
        })?;
    }
    let default: Vec<String> = toolkit::DEFAULT_ARCHS
        .iter()
        .map(|s| s.to_string())
        .collect();
    let flags = toolkit::gencode_flags(&default);
    ensure(flags.len() == default.len() + 1, || format!("{flags:?}"))?;
    ensure(flags[0] == "-gencode=arch=compute_75,code=sm_75", || {
        flags[0].clone()
    })?;
    ensure(
        flags.last().map(String::as_str) == Some("-gencode=arch=compute_120,code=compute_120"),
        || format!("{flags:?}"),
    )
}

/// `nvcc --list-gpu-code` of the PyPI CUDA 13.0.88 and of Debian's 11.8.89.
const GPU_CODES_13_0: &str =
    "sm_75\nsm_80\nsm_86\nsm_87\nsm_88\nsm_89\nsm_90\nsm_100\nsm_110\nsm_103\nsm_120\nsm_121\n";
const GPU_CODES_11_8: &str =
    "sm_35\nsm_37\nsm_50\nsm_52\nsm_53\nsm_60\nsm_61\nsm_62\nsm_70\nsm_72\nsm_75\nsm_80\nsm_86\nsm_87\nsm_89\nsm_90\n";

fn arch_selection_by_toolkit() -> R {
    let new = toolkit::parse_gpu_code_list(GPU_CODES_13_0);
    let old = toolkit::parse_gpu_code_list(GPU_CODES_11_8);
    ensure(
        new.len() == 12 && new[0] == "75" && new[11] == "121",
        || format!("{new:?}"),
    )?;
    let all = ["75", "80", "86", "89", "90", "100", "120"];
    let a = toolkit::select_archs(None, Some(&new), 13000).map_err(|e| e.to_string())?;
    ensure(a == all, || format!("13.0 default: {a:?}"))?;
    let flags = toolkit::gencode_flags(&a);
    ensure(
        flags.len() == 8
            && flags.contains(&"-gencode=arch=compute_100,code=sm_100".to_string())
            && flags.last().map(String::as_str)
                == Some("-gencode=arch=compute_120,code=compute_120"),
        || format!("{flags:?}"),
    )?;
    // 11.8 has no 100 or 120: SASS up to 90, PTX for 90.
    let a = toolkit::select_archs(None, Some(&old), 11080).map_err(|e| e.to_string())?;
    ensure(a == all[..5], || format!("11.8 default: {a:?}"))?;
    let flags = toolkit::gencode_flags(&a);
    ensure(
        flags.last().map(String::as_str) == Some("-gencode=arch=compute_90,code=compute_90"),
        || format!("{flags:?}"),
    )?;
    // Without the list, by version.
    let a = toolkit::select_archs(None, None, 12080).map_err(|e| e.to_string())?;
    ensure(a == all, || format!("12.8 by version: {a:?}"))?;
    let a = toolkit::select_archs(None, None, 11080).map_err(|e| e.to_string())?;
    ensure(a == all[..5], || format!("11.8 by version: {a:?}"))?;
    let a = toolkit::select_archs(None, None, 11040).map_err(|e| e.to_string())?;
    ensure(a == all[..3], || format!("11.4 by version: {a:?}"))?;
    // A future toolkit without 75: the rest.
    let later = toolkit::parse_gpu_code_list("sm_80 sm_90 sm_100 sm_120 sm_130");
    let a = toolkit::select_archs(None, Some(&later), 14000).map_err(|e| e.to_string())?;
    ensure(a == ["80", "90", "100", "120"], || format!("{a:?}"))?;
    // PINSTREAM_CUDA_ARCH narrows, and is checked against the toolkit.
    let req = |s: &str| toolkit::parse_archs(s).map(Some);
    let a = toolkit::select_archs(req("90")?, Some(&old), 11080).map_err(|e| e.to_string())?;
    ensure(a == ["90"], || format!("{a:?}"))?;
    let a = toolkit::select_archs(req("90a,100")?, Some(&new), 13000).map_err(|e| e.to_string())?;
    ensure(a == ["90a", "100"], || format!("{a:?}"))?;
    let e = toolkit::select_archs(req("90,100,120")?, Some(&old), 11080).unwrap_err();
    ensure(
        e.contains("100, 120") && e.contains("11.8") && e.contains("PINSTREAM_CUDA_ARCH"),
        || e.clone(),
    )?;
    let e = toolkit::select_archs(req("70")?, Some(&new), 13000).unwrap_err();
    ensure(e.contains("70") && e.contains("75, 80"), || e.clone())
}

fn cudart_version_and_gates() -> R {
    let header = "#ifndef __CUDA_RUNTIME_API_H__\n/* CUDART_VERSION is ... */\n\
                  #define CUDART_VERSION  11080\n#include \"host_defines.h\"\n";
    let v = toolkit::parse_cudart_version(header);
    ensure(v == Some(11080), || format!("{v:?}"))?;
    ensure(
        toolkit::parse_cudart_version("#define CUDART_VERSIONX 1").is_none(),
        || "CUDART_VERSIONX".into(),
    )?;
    ensure(toolkit::version_name(12080) == "12.8", || {
        toolkit::version_name(12080)
    })?;
    // cudaMemcpyBatchAsync as called here: 13.0 on (12.8 has another signature).
    for (v, want) in [
        (11080, false),
        (12080, false),
        (12090, false),
        (13000, true),
    ] {
        ensure(toolkit::has_batch_copies(v) == want, || format!("{v}"))?;
    }
    // What this build was built with agrees with the library's constant.
    ensure(pinstream::CUDART_VERSION >= 11000, || {
        format!("CUDART_VERSION {}", pinstream::CUDART_VERSION)
    })
}

fn failure_messages_say_what_to_do() -> R {
    let m = toolkit::no_toolkit_message(&["/usr/local/cuda: not a directory".into()], None);
    for needle in [
        "no CUDA toolkit",
        "/usr/local/cuda",
        "PINSTREAM_NO_PROVISION",
        "CUDA_HOME",
        "nvidia-nvvm==13.0.88",
    ] {
        ensure(m.contains(needle), || {
            format!("missing {needle:?} in:\n{m}")
        })?;
    }
    let m = toolkit::no_toolkit_message(&[], Some("pip exploded"));
    ensure(m.contains("pip exploded"), || m.clone())?;
    let m = toolkit::no_libclang_message("not found", None);
    for needle in [
        "libclang",
        "LIBCLANG_PATH",
        "libclang==18.1.1",
        "libclang-dev",
    ] {
        ensure(m.contains(needle), || {
            format!("missing {needle:?} in:\n{m}")
        })?;
    }
    Ok(())
}

/// The build script reads every variable through `env_nonempty`: an empty value is unset.
fn empty_variable_is_unset() -> R {
    ensure(toolkit::nonempty(None).is_none(), || "None".into())?;
    ensure(toolkit::nonempty(Some(OsString::new())).is_none(), || {
        "an empty value counts as set".into()
    })?;
    ensure(
        toolkit::nonempty(Some("/opt/llvm".into())) == Some("/opt/llvm".into()),
        || "a value is lost".into(),
    )?;
    // Through the environment: a variable of this test's own, set to nothing and to a value.
    let key = "PINSTREAM_TEST_ENV_NONEMPTY";
    std::env::set_var(key, "");
    let empty = toolkit::env_nonempty(key);
    std::env::set_var(key, "x");
    let set = toolkit::env_nonempty(key);
    std::env::remove_var(key);
    ensure(empty.is_none() && set == Some("x".into()), || {
        format!("empty: {empty:?}, set: {set:?}")
    })?;
    ensure(toolkit::env_nonempty(key).is_none(), || "unset".into())
}
