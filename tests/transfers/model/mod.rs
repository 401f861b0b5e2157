//! Randomized model-based test of the memory API: random sequences of copies, kernels, host
//! accesses, drops and registrations, run through pinstream's public API from several threads
//! on shared streams, with every host read compared against a plain-Rust model of the data
//! (`Vec<u32>` per buffer, updated as if every op ran in program order).
//!
//! The ordering and tracking guarantees are what makes the two agree: nothing in the test
//! synchronises streams or waits for the GPU by hand. Each thread has its own device buffers
//! (`DeviceBuffer::new` and `new_async`), pinned buffers (random `HostAlloc` flags), plain
//! vectors and `Registered` scopes over them, and reads two buffers shared by all threads; all
//! threads queue on the same few streams per device, so an op on stream B often meets work
//! that another op queued on stream A just before, behind a `Stream::spin`.
//!
//! Which broken guarantee each check catches (`model/sim.rs` demonstrates each one on a
//! simulated GPU, on every `cargo test`, see the `sim/catches/...` trials):
//! - A device-to-host copy's data, read through `Pending::wait()` (or after dropping the
//!   `Pending`), is compared with the model: a missing cross-stream wait in the tracker makes a
//!   D2H on stream B read a buffer before stream A's H2D / D2D / memset / kernel lands (the
//!   destination is poisoned first, so "not arrived" is told apart from "stale")
//!   (`NoCrossStreamWait`); a D2H into a plain slice (or `ReadDev`) that returns before its data
//!   has arrived shows the poison (`PageableD2hAsync`).
//! - Device reads (`ReadDev`, D2H) of a copy's destination catch a write that waits only for
//!   the buffer's last write, not for the reads queued since: a memset / kernel / copy on
//!   stream B overwrites a buffer that a D2D / peer / D2H on stream A, held back by a spin, has
//!   not read yet, so the wrong data arrives (`WriteIgnoresReads`, GPU side).
//! - Host reads through `as_slice()` (and `HostRead` after a `mem::forget`-ed `Pending`) catch
//!   a host access that does not wait for the buffer's last write (`HostAccessNoWait`); host
//!   writes through `as_mut_slice()` (`HostWrite`, `clobber` of a pinned source) followed by
//!   later device reads catch a write that overtakes a queued H2D still reading the buffer
//!   (`HostAccessNoWait`, and `WriteIgnoresReads` when only the reads are not waited for), or
//!   that a queued D2H overwrites afterwards.
//! - Overwriting a plain source right after `copy_h2d` returns (`clobber`) catches a pageable
//!   copy that reads its source after the call returned (staging / bounce-block reuse bugs)
//!   (`PageableH2dLazy`).
//! - Replacing a buffer with work in flight catches a drop that frees without waiting: the
//!   queued work lands in the fresh allocation at the same address, or reads freed memory
//!   (`DropNoWait`).
//! - Reading a plain vector after its `Registered` scope catches an unregister that did not
//!   wait for a copy into it (one whose `Pending` was forgotten) (`ScopeEndNoWait`).
//! - Deliberately invalid calls (length mismatch, range out of bounds, wrong device, D2H into
//!   read-only registered memory) must return the typed error, and a read of the destination
//!   afterwards must show it unchanged: catches missing checks and checks made after queuing
//!   (`ReadOnlyAccepted`, `ErrorAfterQueue`).
//! - At the end every buffer, the shared ones included, is read back and compared.
//!
//! Environment: `PINSTREAM_MODEL_SEED` (default: fresh; printed by every trial and in every
//! failure, with the op index, the last 20 ops and a command line that reproduces it),
//! `PINSTREAM_MODEL_OPS` (ops per thread, default 2000), `PINSTREAM_MODEL_THREADS` (default
//! 4), `PINSTREAM_MODEL_MAX_KIB` (largest device buffer / plain vector, default 1028: copies
//! from plain memory cross 1 MiB now and then). Seed and op count fix every thread's sequence;
//! the interleaving of threads is up to the machine (`gpu/one_thread` has none).
//!
//! GPU trials are ignored where there is no device; the CPU trials check the generator, the
//! model and the runner against the simulation.

mod gpu;
mod plan;
mod run;
mod sim;
mod state;

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use crate::common::{ensure, R};
use libtest_mimic::Trial;
use pinstream::{Device, Error, HostRegister};

use plan::{After, Cfg, Defect, Dev, Gen, Host, On, Op, Step};
use run::{Ctx, Stats};
use sim::{Fault, Sim};
use state::{Expect, Model};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "model/";

#[derive(Clone, Debug)]
struct Env {
    seed: u64,
    ops: usize,
    threads: usize,
    max_kib: usize,
}

impl Env {
    fn read() -> Result<Env, String> {
        fn var<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
            match std::env::var(name) {
                Ok(s) => s
                    .trim()
                    .parse()
                    .map_err(|_| format!("{name}={s:?} is not a number")),
                Err(_) => Ok(default),
            }
        }
        let seed = match std::env::var("PINSTREAM_MODEL_SEED") {
            Ok(s) => {
                let s = s.trim();
                match s.strip_prefix("0x") {
                    Some(hex) => u64::from_str_radix(hex, 16),
                    None => s.parse(),
                }
                .map_err(|_| format!("PINSTREAM_MODEL_SEED={s:?} is not a number"))?
            }
            Err(_) => rand::random(),
        };
        let env = Env {
            seed,
            ops: var("PINSTREAM_MODEL_OPS", 2000)?,
            threads: var("PINSTREAM_MODEL_THREADS", 4)?,
            max_kib: var("PINSTREAM_MODEL_MAX_KIB", 1028)?,
        };
        if env.threads == 0 || env.max_kib < 4 {
            return Err(
                "PINSTREAM_MODEL_THREADS must be >= 1, PINSTREAM_MODEL_MAX_KIB >= 4".into(),
            );
        }
        Ok(env)
    }

    fn repro(&self, trial: &str) -> String {
        format!(
            "PINSTREAM_MODEL_SEED={} PINSTREAM_MODEL_OPS={} PINSTREAM_MODEL_THREADS={} PINSTREAM_MODEL_MAX_KIB={} target/<profile>/deps/transfers-<hash> {PREFIX}{trial} --exact",
            self.seed, self.ops, self.threads, self.max_kib
        )
    }

    fn cfg(&self, devices: usize) -> Cfg {
        Cfg {
            devices,
            streams: 3,
            dev_bufs: 4,
            pinned: 3,
            plain: 3,
            max_len: self.max_kib * 256,
            temp_streams: true,
            peer: devices >= 2,
        }
    }
}

/// SplitMix64: per-thread and per-run seeds from the one seed.
fn mix(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const SHARED: u64 = 0x5A4E_D000;

/// The trials of this module, named `model/...`.
pub fn trials() -> Vec<Trial> {
    let env = match Env::read() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("model: {e}");
            std::process::exit(2);
        }
    };
    let no_gpu = !pinstream::available();
    let two_gpus = Device::count().is_ok_and(|n| n >= 2);

    let mut trials = Vec::new();
    let gpu = |name: &'static str, threads: usize, devices: usize, ignored: bool| {
        let env = env.clone();
        trial(PREFIX, name, move || {
            gpu_trial(&env, name, threads, devices)
        })
        .with_ignored_flag(ignored)
    };
    trials.push(gpu("gpu/one_thread", 1, 1, no_gpu));
    trials.push(gpu("gpu/threads", env.threads, 1, no_gpu));
    trials.push(gpu("gpu/two_devices", env.threads, 2, !two_gpus));

    let cpu = |name: &'static str, f: fn(&Env) -> R| {
        let env = env.clone();
        trial(PREFIX, name, move || f(&env))
    };
    trials.push(cpu("model/helpers", model_helpers));
    trials.push(cpu("model/page_vec_layout", page_vec_layout));
    trials.push(cpu("model/expect_and_apply", expect_and_apply));
    trials.push(cpu("plan/deterministic", plan_deterministic));
    trials.push(cpu("plan/valid_and_covering", plan_valid_and_covering));
    trials.push(cpu("sim/correct_backend_passes", sim_correct));
    for &fault in sim::FAULTS {
        let env = env.clone();
        trials.push(trial(PREFIX, format!("sim/catches/{fault:?}"), move || {
            sim_catches(&env, fault)
        }));
    }
    trials
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "non-text panic".into())
}

/// `threads` threads, each its own random sequence, sharing `cfg.streams` streams per device.
fn gpu_trial(env: &Env, name: &str, threads: usize, devices: usize) -> R {
    let mut cfg = env.cfg(devices);
    // Peer copies where every pair of devices reaches the other both ways (else the API
    // refuses them with `NoPeerAccess`, which the model does not draw).
    let all = Device::all()?;
    for a in all.iter().take(devices) {
        for b in all.iter().take(devices) {
            cfg.peer &= a.can_access_peer(b)?;
        }
    }
    let shared = Arc::new(state::data(mix(env.seed, SHARED), cfg.shared_len()));
    println!(
        "{name}: seed {} (PINSTREAM_MODEL_SEED), {} ops per thread, {threads} thread(s), {devices} device(s), {} streams each, buffers up to {} KiB, peer copies {}",
        env.seed, env.ops, cfg.streams, env.max_kib, cfg.peer
    );
    let world = gpu::World::new(devices, cfg.streams, &shared)?;
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let results: Vec<Result<Stats, String>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (cfg, shared, world, stop) = (&cfg, shared.clone(), &world, &stop);
                sc.spawn(move || -> Result<Stats, String> {
                    let mut gen = Gen::new(cfg, mix(env.seed, t as u64), env.ops);
                    let mut model = Model::new(shared, devices);
                    let mut ctx = Ctx::new(env.seed, t, env.repro(name), Some(stop));
                    let mut thread = gpu::Thread::new(world);
                    run::run(
                        &mut gpu::Exec::new(&mut thread),
                        &mut gen,
                        &mut model,
                        &mut ctx,
                    )?;
                    // Drops every buffer, with whatever is still queued on them.
                    drop(thread);
                    Ok(ctx.stats)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(t, h)| {
                h.join().unwrap_or_else(|p| {
                    Err(format!(
                        "seed {}, thread {t} panicked: {}\n  reproduce: {}",
                        env.seed,
                        panic_text(&*p),
                        env.repro(name)
                    ))
                })
            })
            .collect()
    });
    let mut stats = Stats::default();
    let mut failures = Vec::new();
    for r in results {
        match r {
            Ok(s) => stats.merge(&s),
            Err(e) => failures.push(e),
        }
    }
    println!("{name}: {:.2?}: {}", t0.elapsed(), stats.summary());
    drop(world);
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n\n").into())
    }
}

// ---------------------------------------------------------------------------------------------
// CPU trials: the model's helpers, the generator, and the runner against the simulation.

fn model_helpers(_: &Env) -> R {
    let a = state::data(1, 1000);
    ensure(a == state::data(1, 1000), || {
        "data is not deterministic".into()
    })?;
    ensure(a != state::data(2, 1000), || "data ignores its seed".into())?;
    ensure(state::data(3, 100_000).iter().all(|&v| v != 0), || {
        "data contains a zero".into()
    })?;
    let p = state::poison(1, 1000);
    let same = a.iter().zip(&p).filter(|(x, y)| x == y).count();
    ensure(same == 0, || format!("poison equals data in {same} places"))?;
    ensure(state::memset_word(0xAB) == 0xABAB_ABAB, || {
        "memset word".into()
    })?;
    ensure(
        state::iota(u32::MAX - 1, 3, 4) == [u32::MAX - 1, 1, 4, 7],
        || format!("iota wraps wrong: {:?}", state::iota(u32::MAX - 1, 3, 4)),
    )?;
    ensure(state::iota(5, 0, 3) == [5, 5, 5], || "iota step 0".into())?;
    // compare names the first difference and recognises poison.
    ensure(run::compare(&[1, 2, 3], &[1, 2, 3], None).is_ok(), || {
        "equal slices differ".into()
    })?;
    let e = run::compare(&[1, 9, 8], &[1, 2, 3], Some(&[0, 9, 0])).unwrap_err();
    ensure(
        e.contains("2 of 3") && e.contains("first at 1") && e.contains("poison"),
        || e.clone(),
    )?;
    ensure(run::compare(&[1], &[1, 2], None).is_err(), || {
        "length difference not reported".into()
    })
}

fn page_vec_layout(_: &Env) -> R {
    for len in [0, 1, 3, 1024, 16_385, 300_000] {
        let d = state::data(len as u64, len);
        let mut v = gpu::PageVec::new(&d);
        ensure(v.get() == d, || format!("len {len}: contents"))?;
        let addr = v.get_mut().as_ptr() as usize;
        ensure(addr % gpu::REGISTER_ALIGN == 0, || {
            format!("len {len}: data at {addr:#x} is not aligned")
        })?;
        // The aligned block that holds the last element is ours to its end.
        let end = addr + 4 * len;
        let block_end = end.div_ceil(gpu::REGISTER_ALIGN) * gpu::REGISTER_ALIGN;
        ensure(end + v.tail_bytes() >= block_end, || {
            format!("len {len}: the last aligned block is shared")
        })?;
    }
    Ok(())
}

fn small_model(devices: usize) -> Model {
    let mut m = Model::new(Arc::new(state::data(9, 8)), devices);
    m.dev = vec![state::data(1, 16), state::data(2, 12)];
    m.dev_device = vec![0, devices - 1];
    m.pinned = vec![state::data(3, 8)];
    m.plain = vec![state::data(4, 20)];
    m
}

fn expect_and_apply(_: &Env) -> R {
    let on0 = On::Shared {
        device: 0,
        index: 0,
    };
    let on1 = On::Shared {
        device: 1,
        index: 2,
    };
    let mut m = small_model(2);

    // H2D of a sub-range, then the source overwritten: the device keeps the old data.
    let before = m.plain[0].clone();
    let op = Op::H2d {
        on: on0,
        spin: 0,
        src: Host::Plain(0),
        src_range: 2..7,
        dst: 0,
        dst_range: 10..15,
        wait: false,
        clobber: Some(77),
    };
    ensure(m.expect(&op).is_none(), || "valid h2d refused".into())?;
    m.apply(&op);
    ensure(m.dev[0][10..15] == before[2..7], || "h2d data".into())?;
    ensure(m.plain[0][2..7] == state::data(77, 5)[..], || {
        "clobber".into()
    })?;
    ensure(m.plain[0][..2] == before[..2], || "clobber range".into())?;

    // D2H into the whole pinned buffer, observed as the destination range.
    let op = Op::D2h {
        on: on0,
        spin: 0,
        src: Dev::Own(0),
        src_range: 8..16,
        dst: Host::Pinned(0),
        dst_range: 0..8,
        poison: Some(5),
        after: After::Wait,
    };
    m.apply(&op);
    ensure(m.observe(&op) == Some(m.dev[0][8..16].to_vec()), || {
        "d2h observation".into()
    })?;
    ensure(m.poison_of(&op) == Some(state::poison(5, 8)), || {
        "poison".into()
    })?;

    // Kernels.
    let mut k = |op: Op, want: Vec<u32>| -> R {
        m.apply(&op);
        let got = m.dev[0][3..7].to_vec();
        ensure(got == want, || format!("{op:?}: {got:?} != {want:?}"))
    };
    let (dst, range, spin, on) = (0, 3..7, 0, on0);
    k(
        Op::Memset {
            on,
            spin,
            dst,
            range: range.clone(),
            byte: 0x11,
        },
        vec![0x1111_1111; 4],
    )?;
    k(
        Op::Fill {
            on,
            spin,
            dst,
            range: range.clone(),
            value: 42,
        },
        vec![42; 4],
    )?;
    k(
        Op::Iota {
            on,
            spin,
            dst,
            range,
            start: 10,
            step: 2,
        },
        vec![10, 12, 14, 16],
    )?;

    // Errors, in pinstream's order of checks; reversed ranges do not panic.
    let h2d = |src_range: Range<usize>, dst_range: Range<usize>, on: On| Op::H2d {
        on,
        spin: 0,
        src: Host::Plain(0),
        src_range,
        dst: 0,
        dst_range,
        wait: false,
        clobber: None,
    };
    let peer = |on, src, src_range, dst, dst_range| Op::Peer {
        on,
        spin: 0,
        src,
        src_range,
        dst,
        dst_range,
    };
    let cases: Vec<(Op, Option<Expect>)> = vec![
        (h2d(0..4, 13..17, on0), Some(Expect::OutOfRange)),
        #[allow(clippy::reversed_empty_ranges)]
        (h2d(0..4, 9..5, on0), Some(Expect::OutOfRange)),
        (
            h2d(0..4, 0..5, on0),
            Some(Expect::LengthMismatch { src: 4, dst: 5 }),
        ),
        (
            h2d(0..4, 0..4, on1),
            Some(Expect::WrongDevice {
                expected: 1,
                found: 0,
            }),
        ),
        // Length is checked before the device.
        (
            h2d(0..4, 0..3, on1),
            Some(Expect::LengthMismatch { src: 4, dst: 3 }),
        ),
        (
            Op::D2h {
                on: on0,
                spin: 0,
                src: Dev::Own(0),
                src_range: 0..8,
                dst: Host::Pinned(0),
                dst_range: 0..8,
                poison: None,
                after: After::Wait,
            },
            None,
        ),
        (
            Op::D2h {
                on: on0,
                spin: 0,
                src: Dev::Shared(0),
                src_range: 0..9,
                dst: Host::Plain(0),
                dst_range: 0..9,
                poison: None,
                after: After::Wait,
            },
            Some(Expect::OutOfRange),
        ),
        (
            Op::D2h {
                on: on0,
                spin: 0,
                src: Dev::Own(0),
                src_range: 0..7,
                dst: Host::Pinned(0),
                dst_range: 0..8,
                poison: None,
                after: After::Wait,
            },
            Some(Expect::LengthMismatch { src: 7, dst: 8 }),
        ),
        (
            Op::D2d {
                on: on0,
                spin: 0,
                src: Dev::Own(1),
                src_range: 0..4,
                dst: 0,
                dst_range: 0..4,
            },
            Some(Expect::WrongDevice {
                expected: 0,
                found: 1,
            }),
        ),
        // The same copy with `copy_peer`: on a stream of either device.
        (peer(on0, Dev::Own(1), 0..4, 0, 0..4), None),
        (peer(on1, Dev::Own(1), 0..4, 0, 0..4), None),
        (peer(on1, Dev::Shared(0), 0..4, 1, 8..12), None),
        (
            peer(on0, Dev::Own(1), 0..4, 0, 0..5),
            Some(Expect::LengthMismatch { src: 4, dst: 5 }),
        ),
        (
            peer(on0, Dev::Own(1), 0..13, 0, 0..13),
            Some(Expect::OutOfRange),
        ),
        // Both on device 1: a device-to-device copy, the stream on device 1.
        (
            peer(on0, Dev::Shared(1), 0..4, 1, 0..4),
            Some(Expect::WrongDevice {
                expected: 0,
                found: 1,
            }),
        ),
        (
            Op::Fill {
                on: on1,
                spin: 0,
                dst: 1,
                range: 12..12,
                value: 1,
            },
            None,
        ),
        (
            Op::Fill {
                on: on1,
                spin: 0,
                dst: 1,
                range: 12..13,
                value: 1,
            },
            Some(Expect::OutOfRange),
        ),
    ];
    for (op, want) in &cases {
        let got = m.expect(op);
        ensure(got == *want, || {
            format!("{op:?}: expected {want:?}, model says {got:?}")
        })?;
    }

    // Read-only registration: refused as a D2H destination (whole or slice), fine as a source.
    m.begin_scope(0, HostRegister::READ_ONLY | HostRegister::PORTABLE);
    let d2h_reg = |dst: Host| Op::D2h {
        on: on0,
        spin: 0,
        src: Dev::Own(0),
        src_range: 0..16,
        dst,
        dst_range: 2..18,
        poison: None,
        after: After::Drop,
    };
    ensure(
        m.expect(&d2h_reg(Host::RegSlice)) == Some(Expect::ReadOnly),
        || "d2h into a read-only slice".into(),
    )?;
    let mut whole = d2h_reg(Host::Reg);
    if let Op::D2h { dst_range, .. } = &mut whole {
        *dst_range = 0..20;
    }
    ensure(
        m.expect(&whole) == Some(Expect::LengthMismatch { src: 16, dst: 20 }),
        || "length before read-only".into(),
    )?;
    ensure(m.expect(&h2d(0..4, 0..4, on0)).is_none(), || {
        "h2d from read-only".into()
    })?;
    m.end_scope();
    ensure(m.expect(&d2h_reg(Host::Plain(0))).is_none(), || {
        "d2h into plain after the scope".into()
    })?;

    // Expect::matches against real error values.
    let lm = Error::LengthMismatch {
        op: "Stream::copy_h2d",
        src: 4,
        dst: 5,
    };
    let inv = |op| Error::InvalidArgument {
        op,
        reason: String::new(),
    };
    let checks = [
        (Expect::LengthMismatch { src: 4, dst: 5 }, lm.clone(), true),
        (Expect::LengthMismatch { src: 5, dst: 4 }, lm.clone(), false),
        (Expect::OutOfRange, lm, false),
        (Expect::OutOfRange, inv("DeviceBuffer::slice_mut"), true),
        (Expect::ReadOnly, inv("Stream::copy_d2h"), true),
        (Expect::ReadOnly, inv("DeviceBuffer::slice"), false),
        (
            Expect::WrongDevice {
                expected: 1,
                found: 0,
            },
            Error::WrongDevice {
                op: "kernels::fill",
                expected: 1,
                found: 0,
            },
            true,
        ),
    ];
    for (ex, e, want) in checks {
        ensure(ex.matches(&e) == want, || format!("{ex:?} vs {e:?}"))?;
    }
    Ok(())
}

/// Generation with the model alone (no backend), asserting what every op must satisfy;
/// `visit` sees each step with the model before it. `refuse_ro` plays a platform that cannot
/// register read-only.
fn plan_only(
    cfg: &Cfg,
    seed: u64,
    ops: usize,
    refuse_ro: bool,
    visit: &mut dyn FnMut(&Model, &Step),
) -> Result<Vec<Step>, String> {
    let shared = Arc::new(state::data(seed, cfg.shared_len()));
    let mut m = Model::new(shared, cfg.devices);
    let mut gen = Gen::new(cfg, seed, ops);
    let mut steps = Vec::new();
    let mut n = 0;
    while !gen.done(&m) {
        let step = gen.next(&m);
        let idx = steps.len();
        let fail = |what: String| format!("seed {seed}, op #{idx} {:?}: {what}", step.op);
        if let Some(e) = check_step(cfg, &m, &step) {
            return Err(fail(e));
        }
        visit(&m, &step);
        let expect = m.expect(&step.op);
        if expect.map(Expect::defect) != step.defect {
            return Err(fail(format!(
                "generated as {:?}, the model expects {expect:?}",
                step.defect
            )));
        }
        match step.op {
            Op::ScopeBegin { plain, flags, .. } => {
                if !(refuse_ro && flags.contains(HostRegister::READ_ONLY)) {
                    m.begin_scope(plain, flags);
                }
                n += 1;
            }
            Op::ScopeEnd => m.end_scope(),
            ref op if step.defect.is_none() => {
                m.apply(op);
                n += 1;
            }
            _ => n += 1,
        }
        steps.push(step);
        if steps.len() > 4 * ops + 100 {
            return Err(format!("seed {seed}: the sequence does not end"));
        }
    }
    // Every op but the scope ends counts, after the allocations that open the sequence.
    let prologue = cfg.dev_bufs + cfg.pinned + cfg.plain;
    if n != ops + prologue {
        return Err(format!(
            "seed {seed}: {n} ops, asked for {ops} + {prologue}"
        ));
    }
    Ok(steps)
}

/// Everything an op must satisfy whether or not it is invalid on purpose (host ranges are
/// never out of bounds: slicing them would panic in the test, not test the API).
fn check_step(cfg: &Cfg, m: &Model, step: &Step) -> Option<String> {
    let in_bounds = |r: &Range<usize>, len: usize| r.start <= r.end && r.end <= len;
    let on_ok = |on: On| match on {
        On::Shared { device, index } => device < cfg.devices && index < cfg.streams,
        On::Temp { device } => cfg.temp_streams && device < cfg.devices,
    };
    // `copy`: the API takes whole pinned / registered buffers, so the range is all of it.
    let host_ok = |h: Host, r: &Range<usize>, writes: bool, copy: bool| -> Option<String> {
        let in_scope_ok = match h {
            Host::Reg | Host::RegSlice => m.scope.is_some(),
            Host::Plain(k) => m.scope.is_none_or(|(p, _)| p != k),
            Host::SharedPinned => !writes,
            _ => true,
        };
        if !in_scope_ok {
            return Some(format!("{h:?} is not usable here (scope {:?})", m.scope));
        }
        let len = m.host(h).len();
        if !in_bounds(r, len) || (copy && h.whole() && *r != (0..len)) {
            return Some(format!("host range {r:?} of {h:?} (length {len})"));
        }
        None
    };
    let oor = step.defect == Some(Defect::OutOfRange);
    let dev_ok = |d: Dev, r: &Range<usize>| oor || in_bounds(r, m.dev_len(d));
    let spin_ok = |s: u32| s == 0 || (10..=1000).contains(&s);
    match &step.op {
        Op::H2d {
            on,
            spin,
            src,
            src_range,
            dst,
            dst_range,
            clobber,
            ..
        } => host_ok(*src, src_range, false, true)
            .or_else(|| (!on_ok(*on) || !spin_ok(*spin)).then(|| "stream or spin".into()))
            .or_else(|| (!dev_ok(Dev::Own(*dst), dst_range)).then(|| "device range".into()))
            .or_else(|| {
                (clobber.is_some() && (step.defect.is_some() || *src == Host::SharedPinned))
                    .then(|| "clobber of a refused copy or the shared source".into())
            }),
        Op::D2h {
            on,
            spin,
            src,
            src_range,
            dst,
            dst_range,
            poison,
            ..
        } => host_ok(*dst, dst_range, true, true)
            .or_else(|| (!on_ok(*on) || !spin_ok(*spin)).then(|| "stream or spin".into()))
            .or_else(|| (!dev_ok(*src, src_range)).then(|| "device range".into()))
            .or_else(|| {
                (poison.is_some() && step.defect.is_some())
                    .then(|| "poison before a refused copy".into())
            }),
        Op::D2d {
            on,
            src,
            src_range,
            dst,
            dst_range,
            ..
        } => (!on_ok(*on)).then(|| "stream".into()).or_else(|| {
            (*src == Dev::Own(*dst)
                || !dev_ok(*src, src_range)
                || !dev_ok(Dev::Own(*dst), dst_range))
            .then(|| "d2d buffers or ranges".into())
        }),
        Op::Peer {
            on,
            src,
            src_range,
            dst,
            dst_range,
            ..
        } => (!on_ok(*on) || !cfg.peer)
            .then(|| "stream".into())
            .or_else(|| {
                (m.dev_device(*src) == m.dev_device[*dst]
                    || !dev_ok(*src, src_range)
                    || !dev_ok(Dev::Own(*dst), dst_range))
                .then(|| "peer buffers or ranges".into())
            }),
        Op::Memset { on, dst, range, .. }
        | Op::Fill { on, dst, range, .. }
        | Op::Iota { on, dst, range, .. } => {
            (!on_ok(*on) || !dev_ok(Dev::Own(*dst), range)).then(|| "stream or range".into())
        }
        Op::Spin { on, micros } => {
            (!on_ok(*on) || *micros == 0 || !spin_ok(*micros)).then(|| "spin".into())
        }
        Op::HostWrite { host, range, .. } => host_ok(*host, range, true, false).or_else(|| {
            matches!(host, Host::PinnedSlice(_) | Host::RegSlice)
                .then(|| "host writes name the buffer".into())
        }),
        Op::HostRead { host } => host_ok(*host, &(0..m.host(*host).len()), false, false),
        Op::ReadDev { on, src, .. } => {
            (!on_ok(*on) || on.device() != m.dev_device(*src)).then(|| "read-device stream".into())
        }
        Op::NewDev {
            index,
            device,
            alloc_on,
            len,
            init_on,
            ..
        } => (*index > m.dev.len()
            || *index >= cfg.dev_bufs
            || !(cfg.small_len()..=cfg.max_len).contains(len)
            || alloc_on.is_some_and(|o| !on_ok(o) || o.device() != *device)
            || !on_ok(*init_on)
            || init_on.device() != *device
            || m.scope.is_some())
        .then(|| "new device buffer".into()),
        Op::NewPinned {
            index, device, len, ..
        } => (*index > m.pinned.len()
            || *index >= cfg.pinned
            || *device >= cfg.devices
            || !(1..=cfg.small_len()).contains(len)
            || m.scope.is_some())
        .then(|| "new pinned buffer".into()),
        Op::NewPlain { index, len, .. } => (*index > m.plain.len()
            || *index >= cfg.plain
            || !(1..=cfg.max_len).contains(len)
            || m.scope.is_some())
        .then(|| "new plain vector".into()),
        Op::ScopeBegin { plain, device, .. } => {
            (m.scope.is_some() || *plain >= m.plain.len() || *device >= cfg.devices)
                .then(|| "scope".into())
        }
        Op::ScopeEnd => m
            .scope
            .is_none()
            .then(|| "scope end outside a scope".into()),
    }
}

fn plan_deterministic(env: &Env) -> R {
    let cfg = Cfg {
        max_len: 4096,
        ..env.cfg(2)
    };
    let a = plan_only(&cfg, env.seed, 500, false, &mut |_, _| {})?;
    let b = plan_only(&cfg, env.seed, 500, false, &mut |_, _| {})?;
    ensure(a == b, || {
        format!("seed {}: two sequences differ", env.seed)
    })?;
    let c = plan_only(&cfg, env.seed ^ 1, 500, false, &mut |_, _| {})?;
    ensure(a != c, || "the seed changes nothing".into())
}

/// Every op valid or invalid exactly as generated, every host range in bounds, and every kind
/// of op, operand, stream, flag and defect drawn.
fn plan_valid_and_covering(env: &Env) -> R {
    let mut seen = BTreeSet::new();
    for devices in [1, 2] {
        for refuse_ro in [false, true] {
            for i in 0..4 {
                let cfg = Cfg {
                    max_len: if i % 2 == 0 { 4096 } else { env.max_kib * 256 },
                    ..env.cfg(devices)
                };
                let seed = mix(env.seed, 100 + i);
                plan_only(&cfg, seed, 1500, refuse_ro, &mut |m, step| {
                    seen.extend(features(m, step))
                })?;
            }
        }
    }
    let mut want: Vec<String> = [
        "h2d",
        "d2h+wait",
        "d2h+drop",
        "d2h+forget",
        "d2d",
        "peer",
        "peer-push",
        "peer-pull",
        "memset",
        "fill",
        "iota",
        "spin",
        "host-write",
        "host-read",
        "read-device",
        "new-device-buffer",
        "new-pinned",
        "new-plain",
        "registered-scope",
        "scope-end",
        "temp-stream",
        "spin-before",
        "h2d-wait",
        "clobber",
        "forget+read",
        "forget-in-flight",
        "poisoned",
        "unpoisoned",
        "empty",
        "whole-device-src",
        "whole-device-dst",
        "new_async",
        "new",
        "iota-wraps",
        "read-only-scope",
        "write-combined",
        "mapped",
        "portable",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for h in [
        "Plain",
        "Pinned",
        "PinnedSlice",
        "Reg",
        "RegSlice",
        "SharedPinned",
    ] {
        want.push(format!("h2d-from-{h}"));
        if h != "SharedPinned" {
            want.push(format!("d2h-into-{h}"));
        }
    }
    for d in ["OutOfRange", "LengthMismatch", "WrongDevice", "ReadOnly"] {
        want.push(format!("defect-{d}"));
    }
    want.extend([
        "d2h-from-shared".into(),
        "d2d-from-shared".into(),
        "peer-from-shared".into(),
    ]);
    let missing: Vec<&String> = want.iter().filter(|w| !seen.contains(*w)).collect();
    ensure(missing.is_empty(), || {
        format!("seed {}: never generated: {missing:?}", env.seed)
    })
}

/// The features of a step, for the coverage check (`m`: the state before it).
fn features(m: &Model, step: &Step) -> Vec<String> {
    let host = |h: &Host| {
        let s = format!("{h:?}");
        s.split('(').next().unwrap_or_default().to_string()
    };
    let mut f = vec![step.op.name().to_string()];
    if let Some(d) = step.defect {
        f.push(format!("defect-{d:?}"));
    }
    // Whole buffers are passed as the `DeviceBuffer` itself, other ranges as views.
    let (src, dst) = match &step.op {
        Op::H2d { dst, dst_range, .. } => (None, Some((Dev::Own(*dst), dst_range))),
        Op::D2h { src, src_range, .. } => (Some((*src, src_range)), None),
        Op::D2d {
            src,
            src_range,
            dst,
            dst_range,
            ..
        }
        | Op::Peer {
            src,
            src_range,
            dst,
            dst_range,
            ..
        } => (Some((*src, src_range)), Some((Dev::Own(*dst), dst_range))),
        Op::Memset { dst, range, .. }
        | Op::Fill { dst, range, .. }
        | Op::Iota { dst, range, .. } => (None, Some((Dev::Own(*dst), range))),
        _ => (None, None),
    };
    let whole = |x: Option<(Dev, &Range<usize>)>| {
        step.defect.is_none() && x.is_some_and(|(d, r)| *r == (0..m.dev_len(d)))
    };
    if whole(src) {
        f.push("whole-device-src".into());
    }
    if whole(dst) {
        f.push("whole-device-dst".into());
    }
    let on = match &step.op {
        Op::H2d { on, spin, .. }
        | Op::D2h { on, spin, .. }
        | Op::D2d { on, spin, .. }
        | Op::Peer { on, spin, .. }
        | Op::Memset { on, spin, .. }
        | Op::Fill { on, spin, .. }
        | Op::Iota { on, spin, .. } => {
            if *spin > 0 {
                f.push("spin-before".into());
            }
            Some(*on)
        }
        Op::Spin { on, .. } | Op::ReadDev { on, .. } => Some(*on),
        _ => None,
    };
    if matches!(on, Some(On::Temp { .. })) {
        f.push("temp-stream".into());
    }
    match &step.op {
        Op::H2d {
            src,
            src_range,
            wait,
            clobber,
            ..
        } => {
            f.push(format!("h2d-from-{}", host(src)));
            if *wait {
                f.push("h2d-wait".into());
            }
            if clobber.is_some() {
                f.push("clobber".into());
            }
            if src_range.is_empty() {
                f.push("empty".into());
            }
        }
        Op::D2h {
            src,
            dst,
            poison,
            after,
            ..
        } => {
            f.push(format!("d2h-into-{}", host(dst)));
            f.push(
                if poison.is_some() {
                    "poisoned"
                } else {
                    "unpoisoned"
                }
                .into(),
            );
            match after {
                After::Forget { read: true } => f.push("forget+read".into()),
                After::Forget { read: false } => f.push("forget-in-flight".into()),
                _ => {}
            }
            if matches!(src, Dev::Shared(_)) {
                f.push("d2h-from-shared".into());
            }
        }
        Op::D2d {
            src: Dev::Shared(_),
            ..
        } => f.push("d2d-from-shared".into()),
        Op::Peer { on, src, .. } => {
            f.push(
                if on.device() == m.dev_device(*src) {
                    "peer-push"
                } else {
                    "peer-pull"
                }
                .into(),
            );
            if matches!(src, Dev::Shared(_)) {
                f.push("peer-from-shared".into());
            }
        }
        Op::Iota {
            start, step, range, ..
        } if u64::from(*start) + u64::from(*step) * (range.len() as u64) > u64::from(u32::MAX) => {
            f.push("iota-wraps".into())
        }
        Op::NewDev { alloc_on, .. } => f.push(
            if alloc_on.is_some() {
                "new_async"
            } else {
                "new"
            }
            .into(),
        ),
        Op::NewPinned { flags, .. } => {
            use pinstream::HostAlloc;
            for (flag, name) in [
                (HostAlloc::WRITE_COMBINED, "write-combined"),
                (HostAlloc::MAPPED, "mapped"),
                (HostAlloc::PORTABLE, "portable"),
            ] {
                if flags.contains(flag) {
                    f.push(name.into());
                }
            }
        }
        Op::ScopeBegin { flags, .. } if flags.contains(HostRegister::READ_ONLY) => {
            f.push("read-only-scope".into())
        }
        _ => {}
    }
    f
}

/// One run of the runner on the simulation.
fn sim_run(
    env: &Env,
    trial: &str,
    cfg: &Cfg,
    seed: u64,
    ops: usize,
    fault: Fault,
    refuse_ro: bool,
) -> Result<Stats, String> {
    let shared = Arc::new(state::data(mix(seed, SHARED), cfg.shared_len()));
    let mut sim = Sim::new(cfg.devices, cfg.streams, &shared, seed, fault, refuse_ro);
    let mut gen = Gen::new(cfg, mix(seed, 0), ops);
    let mut model = Model::new(shared, cfg.devices);
    let repro = format!("{} (simulated run with seed {seed})", env.repro(trial));
    let mut ctx = Ctx::new(seed, 0, repro, None);
    run::run(&mut sim, &mut gen, &mut model, &mut ctx)?;
    Ok(ctx.stats)
}

fn sim_cfg(env: &Env, devices: usize) -> Cfg {
    Cfg {
        max_len: 2048,
        ..env.cfg(devices)
    }
}

/// With the rules kept, every read agrees with the model: the runner raises no false alarms.
fn sim_correct(env: &Env) -> R {
    let mut stats = Stats::default();
    for i in 0..12u64 {
        let cfg = sim_cfg(env, 1 + (i % 2) as usize);
        let seed = mix(env.seed, 1000 + i);
        stats.merge(&sim_run(
            env,
            "sim/correct_backend_passes",
            &cfg,
            seed,
            600,
            Fault::None,
            i % 4 >= 2,
        )?);
    }
    println!("sim, seed {}: {}", env.seed, stats.summary());
    ensure(stats.read_only_registrations_refused > 0, || {
        "the refused-registration path never ran".into()
    })
}

/// With one rule broken, some run fails, with a message that names seed and op.
fn sim_catches(env: &Env, fault: Fault) -> R {
    const RUNS: u64 = 100;
    for i in 0..RUNS {
        let cfg = sim_cfg(env, 2);
        let seed = mix(env.seed, 2000 + i);
        if let Err(msg) = sim_run(
            env,
            &format!("sim/catches/{fault:?}"),
            &cfg,
            seed,
            800,
            fault,
            false,
        ) {
            ensure(
                msg.contains(&format!("seed {seed}"))
                    && msg.contains("op #")
                    && msg.contains("last ops"),
                || format!("the failure message lacks seed / op / log:\n{msg}"),
            )?;
            let first: Vec<&str> = msg.lines().take(2).collect();
            println!(
                "{fault:?}: caught in run {} of {RUNS}: {}",
                i + 1,
                first.join(" | ")
            );
            return Ok(());
        }
    }
    Err(format!(
        "seed {}: {fault:?} went unnoticed in {RUNS} simulated runs",
        env.seed
    )
    .into())
}
