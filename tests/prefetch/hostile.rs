//! A hostile caller against the prefetcher's safe API (issue 19: "no hang, abort or panic from
//! any safe call"). Every trial runs under a watchdog (a hang is a failure); the ones that may
//! abort the process run in a child process of this executable.
//!
//! - `*/hang/*`, `*/abort/*`, `*/grow/*`, `*/slow/*`: attacks that broke the API when written
//!   (each names the cause in its doc comment); they fail until it is fixed.
//! - `*/documented/*`: a hang the docs admit to (an iterator source's shards must all be
//!   driven); it fails, so that the limit stays visible.
//! - `*/held/*`: attacks the API withstood, kept as regression tests.
//!
//! `dry/` trials need no GPU ([`DryRun`]); `gpu/` ones run the real [`Prefetcher`] and are
//! ignored where there is none.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{ensure, within, R};
use libtest_mimic::{Failed, Trial};
use pinstream::kernels::{Normalize, Spec};
use pinstream::memory::PoolStats;
use pinstream::prefetch::{
    DryRun, ForeignBytes, HostBatch, HostBytes, LoadError, Pixels, PrefetchConfig, Prefetcher,
    Source,
};
use pinstream::{
    Device, Error, FileSource, HostRegister, PinnedPool, PoolBacking, PoolConfig, Stream,
};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "hostile/";

/// Set in a child process: the name of the trial body it runs.
const CHILD: &str = "PINSTREAM_HOSTILE_CHILD";

type Body = fn() -> R;

/// Bodies that may abort the process: run by [`in_child`] in a process of their own.
const CHILD_BODIES: &[(&str, Body)] = &[
    ("dry_file_larger_than_memory", dry_file_larger_than_memory),
    ("gpu_file_larger_than_memory", gpu_file_larger_than_memory),
];

/// A child process of one of these trials (this executable again, with the variable set): runs
/// its part and returns true, or exits; false in the test runner.
pub fn child_mode() -> bool {
    if let Ok(name) = std::env::var(CHILD) {
        let code = match CHILD_BODIES.iter().find(|(n, _)| *n == name) {
            Some((_, body)) => match body() {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("child {name}: {e:?}");
                    1
                }
            },
            None => 3,
        };
        std::process::exit(code);
    }
    false
}

/// The trials of this module, named `hostile/...`.
pub fn trials() -> Vec<Trial> {
    // The panics these trials provoke are expected: keep them out of the output.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let hostile = info.payload().downcast_ref::<Odd>().is_some()
            || info.payload().downcast_ref::<u32>().is_some()
            || message(info.payload()).is_some_and(|m| {
                m.starts_with("hostile")
                    || m.contains("failed to join")
                    || m.contains("Display implementation")
            });
        if !hostile {
            default_hook(info);
        }
    }));
    let no_gpu = !pinstream::available();
    let dry = |name: &str, f: fn() -> R| trial(PREFIX, format!("dry/{name}"), f);
    let mut trials = vec![
        // Findings.
        dry("hang/iter_next_drops_a_shard", iter_next_drops_a_shard),
        dry("hang/iter_drop_drops_a_shard", iter_drop_drops_a_shard),
        dry(
            "slow/shard_drop_waits_for_other_shards_iterator",
            shard_drop_waits_for_other_shards_iterator,
        ),
        dry("abort/file_larger_than_memory", || {
            in_child("dry_file_larger_than_memory", BOUND)
        }),
        // A documented limit, not a defect: the shards of an iterator source take its items in
        // turn, so they must all be driven; run it with `--include-ignored` to see it hang.
        dry(
            "documented/iter_shards_driven_one_after_another",
            iter_shards_driven_one_after_another,
        )
        .with_ignored_flag(true),
        // Held.
        dry(
            "held/source_fn_drops_its_own_dryrun",
            source_fn_drops_its_own_dryrun,
        ),
        dry("held/odd_panics_and_errors", odd_panics_and_errors),
        dry("held/odd_iterators", odd_iterators),
        dry("held/unfilled_and_bad_batches", unfilled_and_bad_batches),
        dry("held/huge_specs_are_typed_errors", huge_specs),
        dry("held/file_ranges", file_ranges),
        dry("held/pinned_without_pool", pinned_without_pool),
        dry("held/next_after_the_end_many_times", next_after_the_end),
        dry("held/config_limits", config_limits),
        dry("held/config_extremes_run", config_extremes_run),
        dry("held/shard_counts", shard_counts),
        dry(
            "held/shard_dropped_while_other_blocked",
            shard_dropped_while_other_blocked,
        ),
        dry("held/drop_order_games", drop_order_games),
        dry("held/forget_games", forget_games),
        dry(
            "held/two_dryruns_on_one_iter_at_once",
            two_dryruns_on_one_iter,
        ),
        dry(
            "held/drop_while_iterator_blocks",
            drop_while_iterator_blocks,
        ),
        dry("held/foreign_pixel_owners", dry_foreign_owners),
        dry("iter_then/finish_after_the_turn", iter_then_overlaps),
        dry("iter_then/finish_error_at_k", iter_then_finish_error),
        dry("iter_then/finish_panic_at_k", iter_then_finish_panic),
        dry(
            "finding/foreign_owners_outlive_their_upload_after_the_end",
            foreign_owners_outlive_the_run,
        ),
        dry(
            "held/foreign_owner_panics_or_changes_late",
            foreign_owner_misbehaves_late,
        ),
        dry(
            "held/foreign_owner_new_slice_every_call",
            foreign_owner_new_slice_each_call,
        ),
        dry(
            "held/foreign_owner_drop_drops_the_dryrun",
            foreign_owner_drop_drops_the_run,
        ),
    ];
    let mut gpu = |name: &str, f: fn() -> R| {
        trials.push(trial(PREFIX, format!("gpu/{name}"), f).with_ignored_flag(no_gpu));
    };
    gpu("hang/iter_next_drops_a_shard", gpu_iter_next_drops_a_shard);
    gpu(
        "grow/pinned_high_water_poisoned",
        pinned_high_water_poisoned,
    );
    gpu("held/pinned_refused_len_leaves_mark", pinned_refused_len);
    gpu(
        "held/pinned_reuse_never_races_dma",
        pinned_reuse_never_races_dma,
    );
    gpu("held/user_and_read_only_blocks", user_and_read_only_blocks);
    gpu(
        "held/unfilled_and_bad_batches",
        gpu_unfilled_and_bad_batches,
    );
    gpu("held/config_extremes_run", gpu_config_extremes_run);
    gpu("held/foreign_pixel_owners", gpu_foreign_owners);
    gpu(
        "finding/foreign_owners_outlive_their_upload_after_the_end",
        gpu_foreign_owners_outlive_the_run,
    );
    // A deliberate out-of-memory: the sanitizer reports its API error (skip `deliberate_fault`).
    gpu("deliberate_fault/file_larger_than_memory", || {
        in_child("gpu_file_larger_than_memory", BOUND)
    });
    trials
}

// ---------------------------------------------------------------------------------------------
// Harness.

/// A panic payload's message, if it has one.
fn message(p: &(dyn std::any::Any + Send)) -> Option<&str> {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
}

/// How long any trial (or one step of it) may take before it counts as a hang.
const BOUND: Duration = Duration::from_secs(20);

/// Runs the body `name` of [`CHILD_BODIES`] in a child process: an abort (or a kill for memory)
/// there is a failure here, and so is a child still running after `bound` (it is killed).
fn in_child(name: &str, bound: Duration) -> R {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let log = std::env::temp_dir().join(format!(
        "pinstream-hostile-{name}-{}.log",
        std::process::id()
    ));
    let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = file.try_clone().map_err(|e| format!("log: {e}"))?;
    let mut child = Command::new(exe)
        .env(CHILD, name)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("spawn: {e}"))?;
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| format!("wait: {e}"))? {
            break Some(s);
        }
        if t.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    // What the child said, without backtraces.
    let tail: String = {
        let lines: Vec<&str> = out.lines().filter(|l| !l.starts_with(' ')).collect();
        lines[lines.len().saturating_sub(6)..].join("\n")
    };
    match status {
        Some(s) if s.success() => Ok(()),
        Some(s) => {
            use std::os::unix::process::ExitStatusExt;
            Err(match s.signal() {
                Some(sig) => {
                    format!("{name}: the child died of signal {sig} (abort = 6, kill = 9):\n{tail}")
                }
                None => format!("{name}: the child failed ({s}):\n{tail}"),
            }
            .into())
        }
        None => Err(format!("{name}: HUNG (child killed after {bound:?}):\n{tail}").into()),
    }
}

/// Sends on drop, so that a step that unwinds still reports that it is over.
struct Done(mpsc::Sender<()>);

impl Drop for Done {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

fn config(loaders: usize, depth: usize, ahead: usize) -> PrefetchConfig {
    PrefetchConfig {
        loader_threads: loaders,
        depth,
        ahead,
        numa_local: false,
        ..PrefetchConfig::default()
    }
}

/// Batch `i`: one gray 2 x 3 image whose bytes are `i + k`, normalized to themselves (mean 0,
/// std 1), extras `[i]`.
fn small(i: u64) -> HostBatch<i64> {
    let px: Vec<u8> = (0..6).map(|k| (i + k) as u8).collect();
    HostBatch::new(px.into(), small_spec(), vec![i as i64])
}

fn small_spec() -> Spec {
    Spec::variable(1, &[(2, 3)], Normalize::new(&[0.0], &[1.0]))
}

fn fill_small(b: &mut HostBatch<i64>, i: u64) {
    b.spec = small_spec();
    let px = b.pageable();
    px.clear();
    px.extend((0..6).map(|k| (i + k) as u8));
    b.extras.clear();
    b.extras.push(i as i64);
}

/// A function source of `end` small batches.
fn small_source(end: u64) -> Source<i64> {
    Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        fill_small(b, i);
        Ok(true)
    })
}

/// An iterator source of `end` small batches.
fn small_iter(end: u64) -> Source<i64> {
    Source::iter((0..end).map(|i| Ok(small(i))))
}

type Dry = DryRun<f32, i64>;

/// What one dry run gave: the indices of its batches (each checked), and the error that ended
/// it, if one did.
#[derive(Debug, Default)]
struct Got {
    indices: Vec<u64>,
    error: Option<Error>,
}

/// Drains `run`, checking each small batch.
fn drain(run: &mut Dry) -> Result<Got, Failed> {
    let mut got = Got::default();
    while let Some(b) = run.next() {
        match b {
            Ok(b) => {
                let i = b.index();
                let want: Vec<f32> = (0..6).map(|k| ((i + k) as u8) as f32).collect();
                ensure(b.pixels() == want.as_slice(), || {
                    format!("batch {i}: pixels {:?}", b.pixels())
                })?;
                ensure(b.extras() == [i as i64], || {
                    format!("batch {i}: extras {:?}", b.extras())
                })?;
                got.indices.push(i);
            }
            Err(e) => {
                got.error = Some(e);
                break;
            }
        }
    }
    Ok(got)
}

fn is_loader(e: &Option<Error>) -> bool {
    matches!(e, Some(Error::Loader { .. }))
}

fn is_invalid(e: &Error) -> bool {
    matches!(e, Error::InvalidArgument { .. })
}

/// A temporary file removed on drop.
struct Temp(std::path::PathBuf);

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn temp_file(name: &str, len: u64) -> Result<Temp, Failed> {
    static N: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "pinstream-hostile-{name}-{}-{}.bin",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let t = Temp(path);
    let f = std::fs::File::create(&t.0).map_err(|e| format!("{}: {e}", t.0.display()))?;
    f.set_len(len)
        .map_err(|e| format!("{}: set_len({len}): {e}", t.0.display()))?;
    Ok(t)
}

// ---------------------------------------------------------------------------------------------
// Findings: re-entry into an iterator source's turns.

/// A slot through which an iterator gets hold of a dry run made after it.
type Hold<T> = Arc<Mutex<Option<T>>>;

/// Waits (up to 5 s) until `hold` has something, and takes it.
fn take_when_there<T>(hold: &Hold<T>) -> Option<T> {
    let t = Instant::now();
    loop {
        if let Some(x) = hold.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Some(x);
        }
        if t.elapsed() > Duration::from_secs(5) {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// FINDING (hang). `Turns::take` calls the iterator's `next` with the turns' mutex held
/// (src/prefetch/turns.rs:118), and `Turns::abandon` takes that mutex (turns.rs:148), which
/// every prefetcher and dry run does when it stops (`Queue::stop`, loaders.rs:152). So an
/// iterator whose `next` drops a shard of its own source (here shard 1, from shard 0's loader)
/// deadlocks on the mutex its own thread holds: the drop never returns, and neither shard ever
/// sees another batch or an error.
///
/// Fix: never run user code under the turns' lock — take the iterator out of the state (mark
/// the turn busy), unlock, call `next`, lock again and put it back (or, if `abandon` came in
/// meanwhile, drop it outside the lock); likewise drop the iterator outside the lock in `take`
/// and `abandon` (turns.rs:138, :151).
fn iter_next_drops_a_shard() -> R {
    // All of it on the watched thread: a deadlocked pipeline must not be dropped here.
    within(
        "an iterator that drops a shard",
        BOUND,
        iter_next_drops_a_shard_body,
    )
}

fn iter_next_drops_a_shard_body() -> R {
    let hold: Hold<Dry> = Arc::default();
    let (tx, rx) = mpsc::channel();
    let h2 = hold.clone();
    let mut tx = Some(tx);
    let mut n = 0u64;
    let iter = std::iter::from_fn(move || {
        let i = n;
        n += 1;
        if i == 2 {
            // Item 2 is shard 0's: shard 1 goes away from here.
            let _done = tx.take().map(Done);
            drop(take_when_there(&h2));
        }
        (i < 10).then(|| Ok(small(i)))
    });
    let mut shards = DryRun::<f32, i64>::sharded(2, Source::iter(iter), config(1, 2, 1))?;
    *hold.lock().unwrap() = shards.pop();
    let mut shard0 = shards.pop().ok_or("no shard 0")?;
    rx.recv()
        .map_err(|_| Failed::from("the iterator went away"))?;
    // And shard 0 gets an end or an error, not a wait.
    let got = drain(&mut shard0)?;
    ensure(got.indices.first() == Some(&0), || format!("{got:?}"))
}

/// FINDING (hang), same cause as [`iter_next_drops_a_shard`]: the iterator is dropped with the
/// turns' mutex held once it ends (turns.rs:138, `drop_quietly(s.iter.take())` under `s`). An
/// iterator whose `Drop` drops a shard of its own source (which abandons the turns, locking the
/// mutex) deadlocks there, and the shard that met the end hangs with it.
fn iter_drop_drops_a_shard() -> R {
    within(
        "an iterator whose drop drops a shard",
        BOUND,
        iter_drop_drops_a_shard_body,
    )
}

fn iter_drop_drops_a_shard_body() -> R {
    struct Owner {
        n: u64,
        hold: Hold<Dry>,
        done: Option<mpsc::Sender<()>>,
    }
    impl Iterator for Owner {
        type Item = Result<HostBatch<i64>, LoadError>;
        fn next(&mut self) -> Option<Self::Item> {
            let i = self.n;
            self.n += 1;
            (i < 4).then(|| Ok(small(i)))
        }
    }
    impl Drop for Owner {
        fn drop(&mut self) {
            let _done = self.done.take().map(Done);
            drop(take_when_there(&self.hold));
        }
    }
    let hold: Hold<Dry> = Arc::default();
    let (tx, rx) = mpsc::channel();
    let iter = Owner {
        n: 0,
        hold: hold.clone(),
        done: Some(tx),
    };
    let mut shards = DryRun::<f32, i64>::sharded(2, Source::iter(iter), config(1, 2, 0))?;
    *hold.lock().unwrap() = shards.pop();
    let mut shard0 = shards.pop().ok_or("no shard 0")?;
    let got = drain(&mut shard0)?;
    ensure(got.indices == [0, 2] && got.error.is_none(), || {
        format!("{got:?}")
    })?;
    rx.recv()
        .map_err(|_| Failed::from("the iterator went away"))
}

/// FINDING (low: a drop that waits for another shard's source). The same lock held around
/// `next` (turns.rs:118) makes dropping one shard wait for *another* shard's loader to come out
/// of the iterator: `Queue::stop` → `abandon` blocks on the turns' mutex. The docs promise a
/// drop waits only for its own loaders ("a loader that is inside the source at that moment is
/// waited for"). Here shard 1's loader is inside a `next` that takes 3 x BOUND; dropping shard
/// 0, whose own loaders are only waiting for turns, should return at once.
fn shard_drop_waits_for_other_shards_iterator() -> R {
    let (inside_tx, inside_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release_rx = Mutex::new(release_rx);
    let mut n = 0u64;
    let iter = std::iter::from_fn(move || {
        let i = n;
        n += 1;
        if i == 1 {
            let _ = inside_tx.send(());
            let rx = release_rx.lock().unwrap_or_else(|e| e.into_inner());
            let _ = rx.recv_timeout(3 * BOUND);
        }
        (i < 10).then(|| Ok(small(i)))
    });
    let mut shards = DryRun::<f32, i64>::sharded(2, Source::iter(iter), config(1, 2, 0))?;
    let shard1 = shards.pop().ok_or("no shard 1")?;
    let shard0 = shards.pop().ok_or("no shard 0")?;
    inside_rx
        .recv_timeout(BOUND)
        .map_err(|_| "shard 1's loader never got into next()")?;
    let t = Instant::now();
    let r = within("dropping shard 0", Duration::from_secs(5), move || {
        drop(shard0);
        Ok(())
    });
    let took = t.elapsed();
    let _ = release_tx.send(());
    drop(shard1);
    r.map_err(|e| format!("{e:?}: shard 0's drop waits for shard 1's iterator ({took:?})").into())
}

/// FINDING (abort). A `Pixels::File` range inside the file but larger than the machine's memory
/// (a sparse 4 TiB file, a spec that validates): `DryRun`'s fill reads it with `Pixels::read`
/// → `FileSource::read_range`, which allocates with `vec![0u8; len]` (src/staging/file.rs:126,
/// and :137 for O_DIRECT): an allocation failure aborts the process ("memory allocation of N
/// bytes failed") — or with overcommit on, the read faults the pages in until the OOM killer
/// comes. `fit` (dry.rs:23) grows its own vectors with `try_reserve_exact` for this reason; the read
/// does not. Fix: `crate::error::try_vec`/`try_reserve_exact` in `read_range` (an
/// `Error::OutOfMemory` or `InvalidArgument`), or read a dry run's file range in bounded chunks.
fn dry_file_larger_than_memory() -> R {
    let (spec, len) = four_tib_spec()?;
    let Some(file) = sparse(len)? else {
        return Ok(());
    };
    let f2 = file.clone();
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i > 0 {
            return Ok(false);
        }
        b.spec = spec.clone();
        b.set_file(f2.clone(), 0, len);
        b.extras.clear();
        Ok(true)
    });
    let mut run = DryRun::<f32, i64>::new(source, config(1, 1, 1))?;
    let got = run.next();
    ensure(matches!(&got, Some(Err(_))), || {
        format!("a 4 TiB batch: {:?}", got.map(|r| r.map(|b| b.index())))
    })
}

/// One 4 TiB batch that `Spec::validate` accepts: 256 samples of 4 x 65536 x 65535.
fn four_tib_spec() -> Result<(Spec, usize), Failed> {
    let spec = Spec::variable(
        4,
        &[(65_536, 65_535); 256],
        Normalize::new(&[0.0; 4], &[1.0; 4]),
    );
    spec.validate("hostile")?;
    let len = spec.input_len()?;
    Ok((spec, len))
}

/// A sparse file of `len` bytes, or `None` where the filesystem refuses one (the trial then has
/// nothing to show).
fn sparse(len: usize) -> Result<Option<Arc<FileSource>>, Failed> {
    let t = match temp_file("sparse", len as u64) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("no sparse file here: {e:?}");
            return Ok(None);
        }
    };
    let file = Arc::new(FileSource::open(&t.0)?);
    // Unlinked now: the open file stays, and nothing is left behind if the process dies.
    drop(t);
    Ok(Some(file))
}

/// DOCUMENTED HANG. An iterator source's shards must all be driven ("a shard whose consumer
/// stops taking batches holds the others back", `Prefetcher::sharded`): the natural loop that
/// drains shard 0 and then shard 1 hangs in shard 0's `next()` once shard 1's loaders have
/// filled their window (loaders.rs:209), since turn 2k+1 is never taken. No error, no end: a
/// hang in a safe call, which issue 19 rules out. `mem::forget` of one shard does the same.
/// A fix would need the turns to hand item k to any shard that waits (a shared queue rather than
/// fixed turns), or `Turns::take` to run ahead of a shard whose window is full, buffering its
/// items.
fn iter_shards_driven_one_after_another() -> R {
    let mut shards = DryRun::<f32, i64>::sharded(2, small_iter(40), config(2, 2, 0))?;
    let mut shard1 = shards.pop().ok_or("no shard 1")?;
    let mut shard0 = shards.pop().ok_or("no shard 0")?;
    within("draining shard 0, then shard 1", BOUND, move || {
        let a = drain(&mut shard0)?;
        let b = drain(&mut shard1)?;
        ensure(a.indices.len() + b.indices.len() == 40, || {
            format!("{a:?} {b:?}")
        })
    })
}

// ---------------------------------------------------------------------------------------------
// Held: the API withstood these.

/// A function source that drops its own dry run (from its own loader thread): the loader's
/// attempt to join itself panics inside the drop, which the loader catches; nothing hangs.
fn source_fn_drops_its_own_dryrun() -> R {
    let hold: Hold<Dry> = Arc::default();
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(Some(tx));
    let h2 = hold.clone();
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i == 3 {
            let _done = tx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .map(Done);
            drop(take_when_there(&h2));
        }
        fill_small(b, i);
        Ok(i < 10)
    });
    let run = DryRun::<f32, i64>::new(source, config(2, 2, 0))?;
    *hold.lock().unwrap() = Some(run);
    within("the source's drop of its own dry run", BOUND, move || {
        rx.recv().map_err(|_| Failed::from("the source went away"))
    })
}

/// A panic payload of our own type, whose `Drop` may panic again (with a payload that panics
/// again when dropped, up to `depth`).
struct Odd {
    depth: u32,
}

impl Drop for Odd {
    fn drop(&mut self) {
        if self.depth > 0 {
            std::panic::panic_any(Odd {
                depth: self.depth - 1,
            });
        }
    }
}

/// An error whose `Display` fails (`fmt::Error`, which makes `to_string` panic), panics with an
/// odd payload, or whose `Drop` panics with one.
#[derive(Debug)]
enum BadError {
    FmtError,
    DisplayPanicsOdd,
    DropPanicsOdd,
}

impl std::fmt::Display for BadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadError::FmtError => Err(std::fmt::Error),
            BadError::DisplayPanicsOdd => std::panic::panic_any(Odd { depth: 3 }),
            BadError::DropPanicsOdd => f.write_str("hostile drop"),
        }
    }
}

impl std::error::Error for BadError {}

impl Drop for BadError {
    fn drop(&mut self) {
        if matches!(self, BadError::DropPanicsOdd) {
            std::panic::panic_any(Odd { depth: 3 });
        }
    }
}

/// Sources that panic with odd payloads (a `u32`, a payload whose drop panics three levels
/// deep, `resume_unwind` without the hook) or return errors whose `Display`/`Drop` misbehave:
/// each is an `Error::Loader` naming the batch, for a function and an iterator source.
fn odd_panics_and_errors() -> R {
    type Fault = fn(u64) -> Result<HostBatch<i64>, LoadError>;
    let faults: [(&str, Fault); 7] = [
        ("panic u32", |_| std::panic::panic_any(7u32)),
        ("panic odd payload", |_| {
            std::panic::panic_any(Odd { depth: 3 })
        }),
        ("resume_unwind odd", |_| {
            std::panic::resume_unwind(Box::new(Odd { depth: 2 }))
        }),
        ("fmt::Error", |_| Err(Box::new(BadError::FmtError))),
        ("Display panics odd", |_| {
            Err(Box::new(BadError::DisplayPanicsOdd))
        }),
        ("Drop panics odd", |_| {
            Err(Box::new(BadError::DropPanicsOdd))
        }),
        ("empty message", |_| Err("".into())),
    ];
    for (what, fault) in faults {
        for iter in [false, true] {
            let at = 3u64;
            let source = if iter {
                Source::iter((0..10).map(move |i| if i == at { fault(i) } else { Ok(small(i)) }))
            } else {
                Source::new(move |i, b: &mut HostBatch<i64>| {
                    if i == at {
                        *b = fault(i)?;
                    }
                    fill_small(b, i);
                    Ok(i < 10)
                })
            };
            let got = within(what, BOUND, move || {
                let mut run = DryRun::<f32, i64>::new(source, config(3, 2, 0))?;
                let got = drain(&mut run)?;
                // And again after the error, many times.
                for _ in 0..100 {
                    ensure(run.next().is_none(), || "a batch after the error".into())?;
                }
                Ok(got)
            })?;
            ensure(
                got.indices == [0, 1, 2]
                    && matches!(got.error, Some(Error::Loader { batch: 3, .. })),
                || format!("{what} (iter {iter}): {got:?}"),
            )?;
        }
    }
    Ok(())
}

/// Iterators that panic in `next` with odd payloads, panic in `Drop` (at the end and when
/// abandoned), never end (dropped mid-epoch), or yield an error as their very first item.
fn odd_iterators() -> R {
    struct Nasty {
        n: u64,
        panic_at: Option<u64>,
        end: u64,
        drop_panics: bool,
    }
    impl Iterator for Nasty {
        type Item = Result<HostBatch<i64>, LoadError>;
        fn next(&mut self) -> Option<Self::Item> {
            let i = self.n;
            self.n += 1;
            if Some(i) == self.panic_at {
                std::panic::panic_any(Odd { depth: 2 });
            }
            (i < self.end).then(|| Ok(small(i)))
        }
    }
    impl Drop for Nasty {
        fn drop(&mut self) {
            if self.drop_panics {
                std::panic::panic_any(Odd { depth: 2 });
            }
        }
    }
    // Panics in next at 5, and in drop.
    let it = Nasty {
        n: 0,
        panic_at: Some(5),
        end: 100,
        drop_panics: true,
    };
    let got = within("panics in next and drop", BOUND, move || {
        drain(&mut DryRun::<f32, i64>::new(
            Source::iter(it),
            config(4, 3, 0),
        )?)
    })?;
    ensure(
        got.indices == [0, 1, 2, 3, 4] && matches!(got.error, Some(Error::Loader { batch: 5, .. })),
        || format!("panic at 5: {got:?}"),
    )?;
    // Ends at 6, panics in drop.
    let it = Nasty {
        n: 0,
        panic_at: None,
        end: 6,
        drop_panics: true,
    };
    let got = within("panics in drop at the end", BOUND, move || {
        drain(&mut DryRun::<f32, i64>::new(
            Source::iter(it),
            config(4, 3, 0),
        )?)
    })?;
    ensure(got.indices.len() == 6 && got.error.is_none(), || {
        format!("end at 6: {got:?}")
    })?;
    // Endless, dropped mid-epoch: its drop (which panics) runs on abandon.
    let it = Nasty {
        n: 0,
        panic_at: None,
        end: u64::MAX,
        drop_panics: true,
    };
    within("endless, dropped mid-epoch", BOUND, move || {
        let mut run = DryRun::<f32, i64>::new(Source::iter(it), config(4, 3, 0))?;
        for _ in 0..7 {
            let b = run.next().ok_or("ended")??;
            std::hint::black_box(b.index());
        }
        drop(run);
        Ok(())
    })?;
    // An error as the very first item.
    let got = within("error first", BOUND, || {
        let it = std::iter::once(Err::<HostBatch<i64>, LoadError>("hostile first".into()));
        drain(&mut DryRun::<f32, i64>::new(
            Source::iter(it),
            config(2, 1, 0),
        )?)
    })?;
    ensure(
        got.indices.is_empty() && matches!(got.error, Some(Error::Loader { batch: 0, .. })),
        || format!("error first: {got:?}"),
    )?;
    // An empty iterator: no batches, no error.
    let got = within("empty", BOUND, || {
        drain(&mut DryRun::<f32, i64>::new(
            Source::iter(std::iter::empty()),
            config(2, 1, 0),
        )?)
    })?;
    ensure(got.indices.is_empty() && got.error.is_none(), || {
        format!("empty: {got:?}")
    })
}

/// `Ok(true)` without filling a fresh batch (no samples), a spec without pixels, pixels without
/// a spec, a non-monotonic end (false at 2, true after): typed errors or a clean end.
fn unfilled_and_bad_batches() -> R {
    // Ok(true) on a fresh batch: the default spec has no samples.
    let got = within("Ok(true) unfilled", BOUND, || {
        let source = Source::new(|_, _: &mut HostBatch<i64>| Ok(true));
        drain(&mut DryRun::<f32, i64>::new(source, config(2, 2, 0))?)
    })?;
    ensure(got.indices.is_empty() && is_loader(&got.error), || {
        format!("unfilled: {got:?}")
    })?;
    // Filled only at batch 0: a recycled batch returned unfilled re-delivers its last contents
    // (documented: overwrite every field), a fresh one is an error. In order, and no crash.
    let got = within("Ok(true) filled once", BOUND, || {
        let source = Source::new(|i, b: &mut HostBatch<i64>| {
            if i == 0 {
                fill_small(b, 0);
            }
            Ok(i < 30)
        });
        let mut run = DryRun::<f32, i64>::new(source, config(1, 1, 1))?;
        let mut n = 0u64;
        while let Some(b) = run.next() {
            match b {
                Ok(b) => {
                    ensure(b.index() == n, || format!("batch {} for {n}", b.index()))?;
                    n += 1;
                }
                Err(Error::Loader { batch, .. }) if batch == n => return Ok(n),
                Err(e) => return Err(format!("after {n}: {e}").into()),
            }
        }
        Ok(n)
    })?;
    ensure((1..=30).contains(&got), || format!("{got} batches"))?;
    // A spec but no pixels; pixels but the default spec; too many pixels.
    for (what, f) in [
        ("spec, no pixels", 0u8),
        ("pixels, no spec", 1),
        ("one byte too many", 2),
    ] {
        let got = within(what, BOUND, move || {
            let source = Source::new(move |i, b: &mut HostBatch<i64>| {
                fill_small(b, i);
                if i == 1 {
                    match f {
                        0 => b.pageable().clear(),
                        1 => b.spec = HostBatch::<i64>::default().spec,
                        _ => b.pageable().push(1),
                    }
                }
                Ok(i < 5)
            });
            drain(&mut DryRun::<f32, i64>::new(source, config(2, 2, 0))?)
        })?;
        ensure(
            got.indices == [0] && matches!(got.error, Some(Error::Loader { batch: 1, .. })),
            || format!("{what}: {got:?}"),
        )?;
    }
    // The end at 2, batches after it: the end wins.
    let got = within("non-monotonic end", BOUND, || {
        let source = Source::new(|i, b: &mut HostBatch<i64>| {
            fill_small(b, i);
            Ok(i != 2)
        });
        drain(&mut DryRun::<f32, i64>::new(source, config(4, 2, 8))?)
    })?;
    ensure(got.indices == [0, 1] && got.error.is_none(), || {
        format!("end at 2: {got:?}")
    })
}

/// Specs whose sizes overflow, exceed what any allocation can hold, or are merely enormous
/// (validated, with pixels that cannot match): all `Error::Loader`, no abort, no allocation.
fn huge_specs() -> R {
    let n = || Normalize::new(&[0.0; 3], &[1.0; 3]);
    let specs = vec![
        Spec::variable(3, &[(usize::MAX, usize::MAX)], n()),
        Spec::variable(3, &[(1 << 31, 1 << 31)], n()),
        Spec::variable(3, &[(65_536, 65_535); 4096], n()),
        Spec::variable(3, &[(65_536, 65_535); 64], n()),
        Spec::variable(3, &[(1, 1); 70_000], n()),
        Spec::variable(3, &[(usize::MAX / 3, 1)], n()),
    ];
    for (k, spec) in specs.into_iter().enumerate() {
        let got = within("a huge spec", BOUND, move || {
            let source = Source::new(move |i, b: &mut HostBatch<i64>| {
                fill_small(b, i);
                if i == 1 {
                    b.spec = spec.clone();
                }
                Ok(i < 5)
            });
            drain(&mut DryRun::<f32, i64>::new(source, config(2, 2, 0))?)
        })?;
        ensure(
            got.indices == [0] && matches!(got.error, Some(Error::Loader { batch: 1, .. })),
            || format!("spec {k}: {got:?}"),
        )?;
    }
    Ok(())
}

/// File ranges past the end, overflowing, in an empty file, in a file truncated after it was
/// opened, in a directory: `Error::Loader`; a range inside the file is read correctly.
fn file_ranges() -> R {
    let data: Vec<u8> = (0..4096u32).map(|k| (k % 251) as u8).collect();
    let t = temp_file("ranges", 0)?;
    std::fs::write(&t.0, &data).map_err(|e| format!("write: {e}"))?;
    let file = Arc::new(FileSource::open(&t.0)?);
    let empty_t = temp_file("empty", 0)?;
    let empty = Arc::new(FileSource::open(&empty_t.0)?);
    let shrunk_t = temp_file("shrunk", 0)?;
    std::fs::write(&shrunk_t.0, &data).map_err(|e| format!("write: {e}"))?;
    let shrunk = Arc::new(FileSource::open(&shrunk_t.0)?);
    std::fs::File::options()
        .write(true)
        .open(&shrunk_t.0)
        .and_then(|f| f.set_len(10))
        .map_err(|e| format!("truncate: {e}"))?;
    let mut cases: Vec<(&str, Arc<FileSource>, u64, bool)> = vec![
        ("inside", file.clone(), 100, true),
        ("past the end", file.clone(), 4091, false),
        ("offset past the end", file.clone(), 1 << 40, false),
        ("offset + len overflows", file.clone(), u64::MAX - 2, false),
        ("empty file", empty, 0, false),
        ("truncated after open", shrunk, 100, false),
    ];
    // Where a directory opens for reading, its "range" fails at the read.
    if let Ok(dir) = FileSource::open(std::env::temp_dir()) {
        if dir.len() >= 6 {
            cases.push(("a directory", Arc::new(dir), 0, false));
        }
    }
    for (what, f, offset, ok) in cases {
        let got = within(what, BOUND, move || {
            let source = Source::new(move |i, b: &mut HostBatch<i64>| {
                if i >= 2 {
                    return Ok(false);
                }
                b.spec = small_spec();
                b.set_file(f.clone(), offset, 6);
                b.extras.clear();
                b.extras.push(i as i64);
                Ok(true)
            });
            let mut run = DryRun::<f32, i64>::new(source, config(2, 2, 0))?;
            let mut got = Vec::new();
            let mut error = None;
            while let Some(b) = run.next() {
                match b {
                    Ok(b) => got.push(b.pixels().to_vec()),
                    Err(e) => {
                        error = Some(e);
                        break;
                    }
                }
            }
            Ok((got, error))
        })?;
        if ok {
            let at = offset as usize;
            let want: Vec<f32> = data[at..at + 6].iter().map(|&v| f32::from(v)).collect();
            ensure(got.0 == [want.clone(), want] && got.1.is_none(), || {
                format!("{what}: {got:?}")
            })?;
        } else {
            ensure(
                got.0.is_empty() && matches!(got.1, Some(Error::Loader { batch: 0, .. })),
                || format!("{what}: {got:?}"),
            )?;
        }
    }
    Ok(())
}

/// `pinned()` in a dry run (no pool), and on a batch made by the caller: ordinary memory of
/// the length asked, and for a length no memory can have `InvalidArgument` (turned into
/// `Error::Loader` by the dry run), not an abort.
fn pinned_without_pool() -> R {
    let mut b = HostBatch::<i64>::default();
    for len in [0, 1, 4096] {
        let got = b.pinned(len).map(|p| p.len());
        ensure(matches!(got, Ok(l) if l == len), || {
            format!("pinned({len}) on a batch without a pool: {got:?}")
        })?;
    }
    ensure(b.pinned(usize::MAX).is_err_and(|e| is_invalid(&e)), || {
        "pinned(usize::MAX) on a batch without a pool".into()
    })?;
    let got = within("pinned in a dry run", BOUND, || {
        let source = Source::new(|i, b: &mut HostBatch<i64>| {
            b.spec = small_spec();
            b.pinned(usize::MAX)?;
            Ok(i < 3)
        });
        drain(&mut DryRun::<f32, i64>::new(source, config(2, 2, 0))?)
    })?;
    ensure(got.indices.is_empty() && is_loader(&got.error), || {
        format!("{got:?}")
    })
}

/// `next()` after the end, after an error, after a leaked batch, thousands of times.
fn next_after_the_end() -> R {
    within("next after the end", BOUND, || {
        let mut run = DryRun::<f32, i64>::new(small_source(3), config(2, 2, 0))?;
        let got = drain(&mut run)?;
        ensure(got.indices == [0, 1, 2], || format!("{got:?}"))?;
        for _ in 0..10_000 {
            ensure(run.next().is_none(), || "a batch after the end".into())?;
        }
        let mut run = DryRun::<f32, i64>::new(small_source(5), config(2, 2, 0))?;
        for _ in 0..2 {
            let b = run.next().ok_or("ended early")??;
            let _leaked = std::mem::ManuallyDrop::new(b);
        }
        let got = drain(&mut run)?;
        ensure(got.indices == [2, 3, 4], || format!("after leaks: {got:?}"))?;
        for _ in 0..10_000 {
            ensure(run.next().is_none(), || "a batch after the end".into())?;
        }
        Ok(())
    })
}

/// Every limit of `PrefetchConfig::validate`, one past it, and absurd values: refused with
/// `InvalidArgument` by `validate`, `DryRun::new` and `DryRun::sharded`.
fn config_limits() -> R {
    let bad = [
        config(1, 0, 0),
        config(1, 17, 0),
        config(0, 2, 0),
        config(257, 2, 0),
        config(1, 2, 4097),
        config(usize::MAX, usize::MAX, usize::MAX),
        config(1, usize::MAX, 0),
    ];
    for c in bad {
        ensure(c.validate().is_err_and(|e| is_invalid(&e)), || {
            format!("validate accepted {c:?}")
        })?;
        let r = DryRun::<f32, i64>::new(small_source(3), c.clone());
        ensure(r.is_err_and(|e| is_invalid(&e)), || {
            format!("DryRun::new accepted {c:?}")
        })?;
        let r = DryRun::<f32, i64>::sharded(3, small_iter(3), c.clone());
        ensure(r.is_err_and(|e| is_invalid(&e)), || {
            format!("DryRun::sharded accepted {c:?}")
        })?;
    }
    for c in [config(1, 1, 0), config(256, 16, 4096), config(1, 16, 1)] {
        ensure(c.validate().is_ok(), || format!("validate refused {c:?}"))?;
    }
    Ok(())
}

/// The extremes that validate: 256 loaders with a window of 1, 256 loaders and depth 16 with a
/// window of 4096, 1 loader and depth 1: every batch, in order, for both kinds of source.
fn config_extremes_run() -> R {
    for c in [
        config(256, 16, 4096),
        config(256, 1, 1),
        config(1, 1, 1),
        config(1, 16, 0),
        config(256, 16, 0),
    ] {
        for iter in [false, true] {
            let c2 = c.clone();
            let got = within("extreme config", BOUND, move || {
                let source = if iter {
                    small_iter(300)
                } else {
                    small_source(300)
                };
                drain(&mut DryRun::<f32, i64>::new(source, c2)?)
            })?;
            ensure(
                got.error.is_none() && got.indices == (0..300).collect::<Vec<_>>(),
                || {
                    format!(
                        "{c:?} iter {iter}: {} batches, {:?}",
                        got.indices.len(),
                        got.error
                    )
                },
            )?;
        }
    }
    Ok(())
}

/// 0 shards (refused), 1 shard, and many (128 shards of one iterator, driven round-robin):
/// every item exactly once, each shard its own residue class.
fn shard_counts() -> R {
    ensure(
        DryRun::<f32, i64>::sharded(0, small_iter(3), config(1, 1, 0))
            .is_err_and(|e| is_invalid(&e)),
        || "0 shards accepted".into(),
    )?;
    for (shards, iter) in [(1usize, true), (1, false), (128, true), (128, false)] {
        within("many shards", BOUND, move || {
            let end = 1000u64;
            let source = if iter {
                small_iter(end)
            } else {
                small_source(end)
            };
            let mut runs = DryRun::<f32, i64>::sharded(shards, source, config(1, 1, 0))?;
            let mut done = vec![false; shards];
            let mut seen = 0u64;
            while done.iter().any(|d| !d) {
                for (d, run) in runs.iter_mut().enumerate() {
                    if done[d] {
                        continue;
                    }
                    match run.next() {
                        None => done[d] = true,
                        Some(Err(e)) => {
                            return Err(format!("shard {d}: {e}").into());
                        }
                        Some(Ok(b)) => {
                            ensure(b.index() == seen, || {
                                format!("shard {d}: batch {} for {seen}", b.index())
                            })?;
                            seen += 1;
                        }
                    }
                }
            }
            ensure(seen == end, || format!("{shards} shards: {seen} batches"))
        })?;
    }
    Ok(())
}

/// Shard 0's consumer is blocked in `next()` (its next turn belongs to shard 1, whose window is
/// full and which nobody drives); another thread drops shard 1: shard 0's `next()` must return
/// an error (issue 19, 1), with a function source the rest just goes on.
fn shard_dropped_while_other_blocked() -> R {
    for iter in [true, false] {
        let mut shards = DryRun::<f32, i64>::sharded(
            2,
            if iter {
                small_iter(100)
            } else {
                small_source(100)
            },
            config(1, 1, 1),
        )?;
        let shard1 = shards.pop().ok_or("no shard 1")?;
        let mut shard0 = shards.pop().ok_or("no shard 0")?;
        let dropper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(shard1);
        });
        let got = within("shard 0 while shard 1 is dropped", BOUND, move || {
            drain(&mut shard0)
        })?;
        dropper.join().map_err(|_| "the dropper panicked")?;
        if iter {
            ensure(!got.indices.is_empty() && is_loader(&got.error), || {
                format!("iter: {got:?}")
            })?;
        } else {
            ensure(got.indices.len() == 50 && got.error.is_none(), || {
                format!("fn: {got:?}")
            })?;
        }
    }
    Ok(())
}

/// The source dropped before the dry run, clones kept alive past it, the dry run dropped
/// before its batch's use ends (by the borrow, impossible) — and a clone of a finished iterator
/// source given to a new dry run: an error at once, not a wait (issue 19, 4).
fn drop_order_games() -> R {
    within("drop order", BOUND, || {
        let source = small_iter(10);
        let keep = source.clone();
        let mut run = DryRun::<f32, i64>::new(source.clone(), config(2, 2, 0))?;
        drop(source);
        let got = drain(&mut run)?;
        ensure(got.indices.len() == 10 && got.error.is_none(), || {
            format!("{got:?}")
        })?;
        drop(run);
        // The iterator is over: a clone gives an error at once.
        let got = drain(&mut DryRun::<f32, i64>::new(keep.clone(), config(2, 2, 0))?)?;
        ensure(got.indices.is_empty() && is_loader(&got.error), || {
            format!("reused: {got:?}")
        })?;
        // Dropped mid-epoch, then reused.
        let source = small_iter(100);
        let mut run = DryRun::<f32, i64>::new(source.clone(), config(2, 2, 0))?;
        let _first = run.next().ok_or("ended")??;
        drop(run);
        let got = drain(&mut DryRun::<f32, i64>::new(source, config(2, 2, 0))?)?;
        ensure(got.indices.is_empty() && is_loader(&got.error), || {
            format!("reused mid-epoch: {got:?}")
        })?;
        Ok(())
    })
}

/// `mem::forget` of batches and of a whole dry run (its threads leak, by design): a later dry
/// run given a clone of the same iterator source errors instead of waiting for the forgotten
/// one's turns.
fn forget_games() -> R {
    within("forget", BOUND, || {
        let source = small_iter(100);
        let mut run = DryRun::<f32, i64>::new(source.clone(), config(2, 2, 0))?;
        let _leaked = std::mem::ManuallyDrop::new(run.next().ok_or("ended")??);
        std::mem::forget(run);
        let got = drain(&mut DryRun::<f32, i64>::new(source, config(2, 2, 0))?)?;
        ensure(got.indices.is_empty() && is_loader(&got.error), || {
            format!("{got:?}")
        })?;
        let mut run = DryRun::<f32, i64>::new(small_source(20), config(3, 2, 0))?;
        let mut n = 0;
        while let Some(b) = run.next() {
            let _leaked = std::mem::ManuallyDrop::new(b?);
            n += 1;
        }
        ensure(n == 20, || format!("{n} batches with every guard leaked"))
    })
}

/// Two dry runs on clones of one iterator source at the same time (not sharded: both want
/// item 0): whoever loses gets an error, and its stop abandons the other; neither hangs, and no
/// item comes out twice.
fn two_dryruns_on_one_iter() -> R {
    for _ in 0..20 {
        within("two dry runs on one iterator", BOUND, || {
            let source = small_iter(50);
            let mut a = DryRun::<f32, i64>::new(source.clone(), config(3, 2, 0))?;
            let mut b = DryRun::<f32, i64>::new(source, config(3, 2, 0))?;
            let ga = drain(&mut a)?;
            let gb = drain(&mut b)?;
            ensure(ga.error.is_some() || gb.error.is_some(), || {
                format!("both ran: {ga:?} {gb:?}")
            })?;
            Ok(())
        })?;
    }
    Ok(())
}

/// A dry run dropped while a loader is inside a blocking `next` of its iterator (or a blocking
/// function source): the drop waits for it (documented) and returns once it comes out.
fn drop_while_iterator_blocks() -> R {
    for iter in [true, false] {
        let (inside_tx, inside_rx) = mpsc::channel::<()>();
        let blocked = Arc::new(AtomicBool::new(true));
        let b2 = blocked.clone();
        let wait = move |i: u64| {
            if i == 3 {
                let _ = inside_tx.send(());
                while b2.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        let source = if iter {
            Source::iter((0..10).map(move |i| {
                wait(i);
                Ok(small(i))
            }))
        } else {
            Source::new(move |i, b: &mut HostBatch<i64>| {
                wait(i);
                fill_small(b, i);
                Ok(i < 10)
            })
        };
        let mut run = DryRun::<f32, i64>::new(source, config(2, 2, 0))?;
        let _first = run.next().ok_or("ended")??;
        inside_rx
            .recv_timeout(BOUND)
            .map_err(|_| "the loader never got to batch 3")?;
        let releaser = {
            let blocked = blocked.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                blocked.store(false, Ordering::Relaxed);
            })
        };
        within("drop while the source blocks", BOUND, move || {
            drop(run);
            Ok(())
        })?;
        releaser.join().map_err(|_| "the releaser panicked")?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// GPU trials.

/// FINDING (hang) on the GPU: [`iter_next_drops_a_shard`] with `Prefetcher::sharded` on two
/// streams of device 0.
fn gpu_iter_next_drops_a_shard() -> R {
    within(
        "an iterator that drops a shard",
        BOUND,
        gpu_iter_next_drops_a_shard_body,
    )
}

fn gpu_iter_next_drops_a_shard_body() -> R {
    let dev = Device::get(0)?;
    let streams = [dev.stream()?, dev.stream()?];
    let hold: Hold<Prefetcher<f32, i64>> = Arc::default();
    let (tx, rx) = mpsc::channel();
    let h2 = hold.clone();
    let mut tx = Some(tx);
    let mut n = 0u64;
    let iter = std::iter::from_fn(move || {
        let i = n;
        n += 1;
        if i == 2 {
            let _done = tx.take().map(Done);
            drop(take_when_there(&h2));
        }
        (i < 10).then(|| Ok(small(i)))
    });
    let mut shards =
        Prefetcher::<f32, i64>::sharded(&streams, Source::iter(iter), config(1, 2, 1))?;
    *hold.lock().unwrap() = shards.pop();
    let mut shard0 = shards.pop().ok_or("no shard 0")?;
    rx.recv()
        .map_err(|_| Failed::from("the iterator went away"))?;
    while let Some(b) = shard0.next() {
        if b.is_err() {
            break;
        }
    }
    Ok(())
}

fn pool_bytes(s: &PoolStats) -> usize {
    s.cached_bytes + s.in_use_bytes
}

/// FINDING (medium: memory amplification). `PinnedSupply::alloc` (src/prefetch/batch.rs:36-47)
/// makes every block it allocates as long as the longest batch so far plus an eighth, and the
/// mark never comes down. One 64 MiB batch early in an epoch of 4 KiB batches then costs a
/// 72 MiB page-locked block for every later batch that needs a new one — here every batch
/// after it, since the source alternates `pageable()` (which hands the block back) and
/// `pinned(4096)`. The pool ends holding about `(ahead + loaders + depth)` x 72 MiB of pinned
/// memory to move 4 KiB batches (hundreds of MiB; with a 1 GiB outlier, gigabytes pinned, which
/// `max_cached_bytes` does not bound: those blocks are in use).
///
/// Fix: size a new block from `len` (the pool's classes already bound the waste to an eighth),
/// reuse a block already in the batch whenever it fits; or let the mark decay (the longest of
/// the last N batches), and give back a block more than, say, 2x longer than the batch.
fn pinned_high_water_poisoned() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let big = 64usize << 20;
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= 400 {
            return Ok(false);
        }
        let len = if i == 5 { big } else { 4096 };
        b.spec = Spec::variable(1, &[(1, len)], Normalize::new(&[0.0], &[1.0]));
        b.extras.clear();
        b.extras.push(i as i64);
        if i % 2 == 1 {
            // Kinds alternate: the block goes back to the pool, the next pinned() takes one.
            b.pageable();
        }
        let px = b.pinned(len)?;
        px.fill(i as u8);
        Ok(true)
    });
    let c = config(4, 2, 0);
    let staging = c.stager.slots * c.stager.slot_bytes;
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, c)?;
    let mut worst = PoolStats::default();
    let mut i = 0u64;
    while let Some(b) = p.next() {
        let b = b?;
        ensure(b.index() == i, || format!("batch {} for {i}", b.index()))?;
        if i > 100 {
            let s = b.pinned_stats();
            if pool_bytes(&s) > pool_bytes(&worst) {
                worst = s;
            }
        }
        i += 1;
    }
    stream.synchronize()?;
    // Long after the big batch, the pool should hold the big block at most once (it may stay
    // cached) plus small blocks and the staging slots.
    let bound = staging + 2 * (big + big / 8) + 64 * (64 << 10);
    ensure(pool_bytes(&worst) <= bound, || {
        format!(
            "4 KiB batches long after one 64 MiB batch: the pool holds {} MiB ({} MiB in use, \
             {} requested bytes), bound {} MiB: {worst:?}",
            pool_bytes(&worst) >> 20,
            worst.in_use_bytes >> 20,
            worst.requested_bytes,
            bound >> 20
        )
    })
}

/// A refused `pinned(len)` (usize::MAX, more than the machine's memory) is a typed error and
/// leaves the high-water mark alone: later 4 KiB batches get 4 KiB-class blocks.
fn pinned_refused_len() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let refused = Arc::new(AtomicUsize::new(0));
    let r2 = refused.clone();
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= 50 {
            return Ok(false);
        }
        for len in [usize::MAX, usize::MAX / 2, 1 << 50] {
            match b.pinned(len) {
                Err(Error::InvalidArgument { .. } | Error::OutOfMemory { .. }) => {
                    r2.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => return Err(format!("pinned({len}): {e}").into()),
                Ok(_) => return Err(format!("pinned({len}) succeeded").into()),
            }
        }
        b.spec = small_spec();
        b.pinned(6)?.copy_from_slice(&[1, 2, 3, 4, 5, 6]);
        b.extras.clear();
        b.extras.push(i as i64);
        Ok(true)
    });
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, config(4, 2, 0))?;
    let mut n = 0;
    let mut worst = PoolStats::default();
    while let Some(b) = p.next() {
        let b = b?;
        let px = b.pixels()?;
        let mut h = vec![0f32; 6];
        b.stream().copy_d2h(&px, &mut h[..])?.wait()?;
        ensure(h == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], || {
            format!("batch {n}: {h:?}")
        })?;
        let s = b.pinned_stats();
        if pool_bytes(&s) > pool_bytes(&worst) {
            worst = s;
        }
        n += 1;
    }
    ensure(n == 50 && refused.load(Ordering::Relaxed) == 150, || {
        format!("{n} batches, {} refusals", refused.load(Ordering::Relaxed))
    })?;
    let c = config(4, 2, 0);
    let bound = c.stager.slots * c.stager.slot_bytes + 64 * 4096;
    ensure(pool_bytes(&worst) <= bound, || {
        format!("the refused lengths grew the pool: {worst:?}")
    })
}

/// Page-locked pixels whose length varies by batch, reused through `set_len` while earlier
/// DMAs from the same blocks may still run: every batch arrives with exactly its own bytes
/// (a host write racing a DMA, or a slice past the length, would show as another batch's bytes
/// or a wrong length). Batches of up to 2 MiB, so that the copies take a while.
fn pinned_reuse_never_races_dma() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let end = 300u64;
    let len_of = |i: u64| ((i * 7919) % 97 + 1) as usize * (20 << 10) + (i % 13) as usize;
    let byte = |i: u64, chunk: usize| (i as usize).wrapping_mul(31).wrapping_add(chunk) as u8;
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        let len = len_of(i);
        b.spec = Spec::variable(1, &[(1, len)], Normalize::new(&[0.0], &[1.0]));
        b.extras.clear();
        b.extras.push(i as i64);
        let px = b.pinned(len)?;
        for (c, chunk) in px.chunks_mut(4096).enumerate() {
            chunk.fill(byte(i, c));
        }
        Ok(true)
    });
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, config(4, 3, 0))?;
    let mut i = 0u64;
    let mut h: Vec<f32> = Vec::new();
    while let Some(b) = p.next() {
        let b = b?;
        let len = len_of(i);
        let px = b.pixels()?;
        ensure(px.len() == len, || {
            format!("batch {i}: {} elements, want {len}", px.len())
        })?;
        h.clear();
        h.resize(len, f32::NAN);
        b.stream().copy_d2h(&px, &mut h[..])?.wait()?;
        // Every 61st element and the last: each 4 KiB chunk is checked in many places.
        let bad = (0..len)
            .step_by(61)
            .chain([len - 1])
            .find(|&k| h[k] != f32::from(byte(i, k / 4096)));
        ensure(bad.is_none(), || {
            format!("batch {i}: element {bad:?} is another batch's byte")
        })?;
        i += 1;
    }
    ensure(i == end, || format!("{i} batches"))
}

/// Blocks of the caller's own pools — a default one and a `READ_ONLY`-registered one, on the
/// prefetcher's device — put in `pixels`, then reused by `pinned()` (it keeps any idle block of
/// the device that is long enough, as documented): uploads are right, and once the prefetcher
/// is gone every block is back in its pool.
fn user_and_read_only_blocks() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let mine = PinnedPool::new(&dev, PoolConfig::default())?;
    let ro = PinnedPool::new(
        &dev,
        PoolConfig {
            backing: PoolBacking::Register {
                threads: 1,
                huge_pages: false,
                flags: HostRegister::READ_ONLY,
            },
            ..PoolConfig::default()
        },
    )?;
    // Read-only registration is not supported everywhere: then the second kind is a default
    // block too.
    let ro = match ro.alloc::<u8>(4096) {
        Ok(_) => ro,
        Err(e) => {
            eprintln!("no READ_ONLY registration here ({e}): default blocks instead");
            mine.clone()
        }
    };
    let (m2, r2) = (mine.clone(), ro.clone());
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= 60 {
            return Ok(false);
        }
        let len = 5000 + (i as usize % 7) * 100;
        b.spec = Spec::variable(1, &[(1, len)], Normalize::new(&[0.0], &[1.0]));
        b.extras.clear();
        b.extras.push(i as i64);
        let fill = |px: &mut [u8]| {
            px.iter_mut()
                .enumerate()
                .for_each(|(k, v)| *v = (i as usize + k) as u8)
        };
        match i % 3 {
            0 => {
                let mut blk = m2.alloc::<u8>(len)?;
                fill(blk.as_mut_slice()?);
                b.pixels = Pixels::Pinned(blk);
            }
            1 => {
                let mut blk = r2.alloc::<u8>(len)?;
                fill(blk.as_mut_slice()?);
                b.pixels = Pixels::Pinned(blk);
            }
            _ => fill(b.pinned(len)?),
        }
        Ok(true)
    });
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, config(3, 2, 0))?;
    let mut i = 0u64;
    while let Some(b) = p.next() {
        let b = b?;
        let len = 5000 + (i as usize % 7) * 100;
        let mut h = vec![f32::NAN; len];
        b.stream().copy_d2h(&b.pixels()?, &mut h[..])?.wait()?;
        let bad = h
            .iter()
            .enumerate()
            .position(|(k, &v)| v != f32::from((i as usize + k) as u8));
        ensure(bad.is_none(), || format!("batch {i}: element {bad:?}"))?;
        i += 1;
    }
    ensure(i == 60, || format!("{i} batches"))?;
    drop(p);
    stream.synchronize()?;
    for (what, pool) in [("default", &mine), ("read-only", &ro)] {
        let s = pool.stats();
        ensure(s.in_use_bytes == 0 && s.requested_bytes == 0, || {
            format!("the caller's {what} pool after the prefetcher: {s:?}")
        })?;
    }
    Ok(())
}

/// On the GPU: `Ok(true)` unfilled, a spec without pixels, huge specs with small pixels, an
/// empty `pinned(0)`, a resident range past its buffer: `Error::Loader`, no panic.
fn gpu_unfilled_and_bad_batches() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let resident = Arc::new(pinstream::PinnedBuffer::<u8>::new(
        &dev,
        100,
        Default::default(),
    )?);
    for k in 0..6u8 {
        let res = resident.clone();
        let source = Source::new(move |i, b: &mut HostBatch<i64>| {
            if i == 0 {
                fill_small(b, 0);
                return Ok(true);
            }
            match k {
                0 => *b = HostBatch::default(),
                1 => {
                    b.spec = small_spec();
                    b.pageable().clear();
                }
                2 => {
                    b.spec = Spec::variable(
                        3,
                        &[(65_536, 65_535); 4096],
                        Normalize::new(&[0.0; 3], &[1.0; 3]),
                    );
                }
                3 => {
                    b.spec = small_spec();
                    b.pinned(0)?;
                }
                4 => {
                    b.spec = small_spec();
                    b.set_resident(res.clone(), 97, 6);
                }
                _ => {
                    b.spec = small_spec();
                    b.set_resident(res.clone(), usize::MAX, 6);
                }
            }
            Ok(true)
        });
        let got = within("a bad batch on the GPU", BOUND, move || {
            let mut p = Prefetcher::<f32, i64>::new(&stream_of(0)?, source, config(2, 2, 0))?;
            let mut n = 0;
            loop {
                match p.next() {
                    Some(Ok(_)) => n += 1,
                    Some(Err(e)) => return Ok((n, Some(e))),
                    None => return Ok((n, None)),
                }
            }
        })?;
        ensure(
            got.0 == 1 && matches!(got.1, Some(Error::Loader { batch: 1, .. })),
            || format!("case {k}: {got:?}"),
        )?;
    }
    stream.synchronize()?;
    Ok(())
}

fn stream_of(ordinal: usize) -> Result<Stream, Failed> {
    Ok(Device::get(ordinal)?.stream()?)
}

/// The extremes that validate, on the GPU: 256 loaders, depth 16, a window of 4096; and 1, 1, 1.
fn gpu_config_extremes_run() -> R {
    for c in [config(256, 16, 4096), config(1, 1, 1), config(256, 1, 0)] {
        for iter in [false, true] {
            let c2 = c.clone();
            let n = within("extreme config on the GPU", BOUND, move || {
                let source = if iter {
                    small_iter(200)
                } else {
                    small_source(200)
                };
                let stream = stream_of(0)?;
                let mut p = Prefetcher::<f32, i64>::new(&stream, source, c2)?;
                let mut n = 0u64;
                while let Some(b) = p.next() {
                    let b = b?;
                    ensure(b.index() == n, || format!("batch {} for {n}", b.index()))?;
                    if n % 50 == 0 {
                        let mut h = vec![0f32; 6];
                        b.stream().copy_d2h(&b.pixels()?, &mut h[..])?.wait()?;
                        let want: Vec<f32> = (0..6).map(|k| ((n + k) as u8) as f32).collect();
                        ensure(h == want, || format!("batch {n}: {h:?}"))?;
                    }
                    n += 1;
                }
                Ok(n)
            })?;
            ensure(n == 200, || format!("{c:?} iter {iter}: {n} batches"))?;
        }
    }
    Ok(())
}

/// The GPU prefetcher given the 4 TiB file range of [`dry_file_larger_than_memory`]: its slot
/// cannot grow that far, a typed error (run in a child process, in case it aborts).
fn gpu_file_larger_than_memory() -> R {
    let (spec, len) = four_tib_spec()?;
    let Some(file) = sparse(len)? else {
        return Ok(());
    };
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i > 0 {
            return Ok(false);
        }
        b.spec = spec.clone();
        b.set_file(file.clone(), 0, len);
        b.extras.clear();
        Ok(true)
    });
    let stream = stream_of(0)?;
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, config(1, 1, 1))?;
    let got = p.next();
    ensure(matches!(&got, Some(Err(_))), || {
        format!("a 4 TiB batch: {:?}", got.map(|r| r.map(|b| b.index())))
    })
}

// ---------------------------------------------------------------------------------------------
// Pixels owned by someone else (`Pixels::Foreign`): user code in `bytes` and `Drop`.

/// An owner of batch `i`'s bytes that misbehaves as `how` says.
struct Owner {
    bytes: Vec<u8>,
    how: Misbehave,
    calls: AtomicUsize,
}

#[derive(Clone, Copy, PartialEq)]
enum Misbehave {
    Not,
    PanicInBytes,
    PanicInDrop,
    /// The whole slice on the first call, half of it afterwards.
    Shrinks,
}

impl HostBytes for Owner {
    fn bytes(&self) -> &[u8] {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        match self.how {
            Misbehave::PanicInBytes => panic!("an owner that panics in bytes()"),
            Misbehave::Shrinks if n > 0 => &self.bytes[..self.bytes.len() / 2],
            _ => &self.bytes,
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        if self.how == Misbehave::PanicInDrop {
            panic!("an owner that panics in drop");
        }
    }
}

/// Batch `i` of the foreign-owner source: `small(i)`'s bytes, held by an owner that panics in
/// `bytes` at batch 3, in `Drop` at even batches, and shrinks at batch 5.
fn foreign_source(end: u64) -> Source<i64> {
    Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        let how = match i {
            3 => Misbehave::PanicInBytes,
            5 => Misbehave::Shrinks,
            i if i % 2 == 0 => Misbehave::PanicInDrop,
            _ => Misbehave::Not,
        };
        b.spec = small_spec();
        b.extras.clear();
        b.extras.push(i as i64);
        b.pixels = Pixels::Foreign(ForeignBytes::new(Owner {
            bytes: (0..6).map(|k| (i + k) as u8).collect(),
            how,
            calls: AtomicUsize::new(0),
        }));
        Ok(true)
    })
}

/// The dry run: batches 0..3 whole (the ones whose owner panics in `Drop` too), batch 3 a
/// loader error naming the panic; nothing panics out, nothing hangs.
fn dry_foreign_owners() -> R {
    within("foreign pixel owners (dry)", BOUND, || {
        let mut run = Dry::new(foreign_source(8), config(2, 2, 2))?;
        let got = drain(&mut run)?;
        ensure(got.indices == [0, 1, 2], || format!("{got:?}"))?;
        ensure(
            matches!(&got.error, Some(Error::Loader { batch: 3, message }) if message.contains("panics in bytes")),
            || format!("{got:?}"),
        )
    })
}

/// The same on the GPU, and past batch 3 (a fresh prefetcher from batch 4): the shrinking
/// owner of batch 5 is an error, never a short copy; batch 4's and 6's pixels are right.
fn gpu_foreign_owners() -> R {
    within("foreign pixel owners (gpu)", BOUND, || {
        let dev = Device::get(0)?;
        let s = dev.stream()?;
        let check = |p: &mut Prefetcher<f32, i64>, want: &[u64]| -> Result<Option<Error>, Failed> {
            let mut seen = Vec::new();
            while let Some(b) = p.next() {
                match b {
                    Ok(b) => {
                        let i = b.index();
                        let mut px = vec![f32::NAN; 6];
                        s.copy_d2h(&b.pixels()?, &mut px[..])?.wait()?;
                        let exp: Vec<f32> = (0..6).map(|k| ((i + k) as u8) as f32).collect();
                        ensure(px == exp, || format!("batch {i}: {px:?}"))?;
                        seen.push(i);
                    }
                    Err(e) => {
                        ensure(seen == want, || format!("{seen:?} then {e}"))?;
                        return Ok(Some(e));
                    }
                }
            }
            ensure(seen == want, || format!("{seen:?}"))?;
            Ok(None)
        };
        let mut p = Prefetcher::<f32, i64>::new(&s, foreign_source(8), config(2, 2, 2))?;
        let e = check(&mut p, &[0, 1, 2])?;
        ensure(matches!(e, Some(Error::Loader { batch: 3, .. })), || {
            format!("{e:?}")
        })?;
        drop(p);
        let from4 = Source::new(|i, b: &mut HostBatch<i64>| {
            if i + 4 >= 8 {
                return Ok(false);
            }
            let how = if i + 4 == 5 {
                Misbehave::Shrinks
            } else {
                Misbehave::PanicInDrop
            };
            b.spec = small_spec();
            b.extras.clear();
            b.extras.push(i as i64);
            b.pixels = Pixels::Foreign(ForeignBytes::new(Owner {
                bytes: (0..6).map(|k| (i + k) as u8).collect(),
                how,
                calls: AtomicUsize::new(0),
            }));
            Ok(true)
        });
        let mut p = Prefetcher::<f32, i64>::new(&s, from4, config(1, 2, 1))?;
        let e = check(&mut p, &[0])?;
        ensure(e.is_some(), || "a shrinking owner was uploaded".into())
    })
}

// ---------------------------------------------------------------------------------------------
// More foreign owners: when they are dropped, late misbehaviour, reentrant drops.

/// Owners alive now (made minus dropped).
static LIVE_OWNERS: AtomicUsize = AtomicUsize::new(0);

/// An owner that counts itself in [`LIVE_OWNERS`].
struct Counted(Vec<u8>);

impl Counted {
    fn new(bytes: Vec<u8>) -> Counted {
        LIVE_OWNERS.fetch_add(1, Ordering::SeqCst);
        Counted(bytes)
    }
}

impl HostBytes for Counted {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        LIVE_OWNERS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// FINDING (leak, bounded): `Pixels::Foreign` says the owner is "held by the batch until it is
/// uploaded", but the feeder put every uploaded batch, pixels and all, on the loaders' spare
/// list, where the owner stayed until a loader reused that batch; after the last batch no loader
/// does, so the owners of the last `window` batches (a numpy array each, from Python) lived until
/// the run was dropped. Now the spares are emptied when the pipeline stops: soon after `next()`
/// has returned `None` (the last loaders return from the source), no owner is alive.
fn foreign_owners_outlive_the_run() -> R {
    within("foreign owners after the end", BOUND, || {
        for (iter, loaders, depth, ahead) in [(false, 2, 2, 4), (true, 1, 1, 0), (false, 4, 3, 8)] {
            let base = LIVE_OWNERS.load(Ordering::SeqCst);
            let batch = |i: u64| {
                HostBatch::new(
                    Pixels::Foreign(ForeignBytes::new(Counted::new(
                        (0..6).map(|k| (i + k) as u8).collect(),
                    ))),
                    small_spec(),
                    vec![i as i64],
                )
            };
            let source = if iter {
                Source::iter((0..12).map(move |i| Ok(batch(i))))
            } else {
                Source::new(move |i, b: &mut HostBatch<i64>| {
                    if i >= 12 {
                        return Ok(false);
                    }
                    *b = batch(i);
                    Ok(true)
                })
            };
            let mut run = Dry::new(source, config(loaders, depth, ahead))?;
            let got = drain(&mut run)?;
            ensure(got.indices.len() == 12 && got.error.is_none(), || {
                format!("{got:?}")
            })?;
            // The last loaders may still be returning from the source: give them a moment.
            let t = Instant::now();
            while LIVE_OWNERS.load(Ordering::SeqCst) > base && t.elapsed() < Duration::from_secs(2)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            let live = LIVE_OWNERS.load(Ordering::SeqCst) - base;
            drop(run);
            let after = LIVE_OWNERS.load(Ordering::SeqCst) - base;
            ensure(live == 0 && after == 0, || {
                format!(
                    "iter {iter}, {loaders} loaders, depth {depth}, ahead {ahead}: {live} owners \
                     alive after the last batch ({after} after the drop)"
                )
            })?;
        }
        Ok(())
    })
}

/// How a late owner misbehaves: well on the first `good` calls of `bytes`, then as `how`.
#[derive(Clone, Copy, Debug)]
enum Late {
    Panics,
    Grows,
    Empties,
}

struct LateOwner {
    bytes: Vec<u8>,
    good: usize,
    how: Late,
    calls: AtomicUsize,
}

impl HostBytes for LateOwner {
    fn bytes(&self) -> &[u8] {
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.good {
            return &self.bytes[..6];
        }
        match self.how {
            Late::Panics => std::panic::panic_any(Odd { depth: 2 }),
            Late::Grows => &self.bytes,
            Late::Empties => &[],
        }
    }
}

/// Owners that behave for their first one or two calls of `bytes` and then panic (with a
/// payload whose drop panics again), grow, or empty: the batch is an error (never a panic out
/// of `next`, never a batch normalized from bytes of the wrong length), and the batches before it
/// are right.
fn foreign_owner_misbehaves_late() -> R {
    within("late foreign owners", BOUND, || {
        for how in [Late::Panics, Late::Grows, Late::Empties] {
            // A dry run calls `bytes` three times per batch (the check, the length, the read).
            for good in 1..3 {
                let source = Source::new(move |i, b: &mut HostBatch<i64>| {
                    if i >= 4 {
                        return Ok(false);
                    }
                    b.spec = small_spec();
                    b.extras.clear();
                    b.extras.push(i as i64);
                    let mut bytes: Vec<u8> = (0..6).map(|k| (i + k) as u8).collect();
                    bytes.extend([0; 6]);
                    b.pixels = Pixels::Foreign(ForeignBytes::new(LateOwner {
                        bytes,
                        good: if i == 2 { good } else { usize::MAX },
                        how,
                        calls: AtomicUsize::new(0),
                    }));
                    Ok(true)
                });
                let mut run = Dry::new(source, config(2, 2, 2))?;
                let got = drain(&mut run)?;
                ensure(got.indices == [0, 1] && got.error.is_some(), || {
                    format!("{how:?} after {good} calls: {got:?}")
                })?;
            }
        }
        Ok(())
    })
}

/// An owner that gives a fresh copy of its bytes (another address) on every call: each batch is
/// still right.
struct Copies {
    bytes: Vec<u8>,
    copies: [std::sync::OnceLock<Vec<u8>>; 16],
    calls: AtomicUsize,
}

impl HostBytes for Copies {
    fn bytes(&self) -> &[u8] {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) % self.copies.len();
        self.copies[n].get_or_init(|| self.bytes.clone())
    }
}

fn foreign_owner_new_slice_each_call() -> R {
    within("foreign owner with fresh slices", BOUND, || {
        let source = Source::new(|i, b: &mut HostBatch<i64>| {
            if i >= 20 {
                return Ok(false);
            }
            b.spec = small_spec();
            b.extras.clear();
            b.extras.push(i as i64);
            b.pixels = Pixels::Foreign(ForeignBytes::new(Copies {
                bytes: (0..6).map(|k| (i + k) as u8).collect(),
                copies: Default::default(),
                calls: AtomicUsize::new(0),
            }));
            Ok(true)
        });
        let mut run = Dry::new(source, config(3, 2, 4))?;
        let got = drain(&mut run)?;
        ensure(got.indices.len() == 20 && got.error.is_none(), || {
            format!("{got:?}")
        })
    })
}

/// An owner whose `Drop` drops the dry run that uploaded it (the run is parked in a shared slot
/// once the consumer has taken two batches): on whichever pipeline thread that drop runs, the
/// run goes away without a hang or an abort.
struct DropsTheRun {
    bytes: Vec<u8>,
    hold: Hold<Dry>,
    done: Option<Done>,
}

impl HostBytes for DropsTheRun {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for DropsTheRun {
    fn drop(&mut self) {
        let run = self.hold.lock().unwrap_or_else(|e| e.into_inner()).take();
        if run.is_some() {
            drop(run);
            drop(self.done.take());
        }
    }
}

fn foreign_owner_drop_drops_the_run() -> R {
    let hold: Hold<Dry> = Arc::default();
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let h2 = hold.clone();
    let parked = Arc::new(AtomicBool::new(false));
    let parked2 = parked.clone();
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= 1000 {
            return Ok(false);
        }
        // Past the two batches the consumer takes, wait until the run is parked: the owners
        // these loads replace then drop after it is (otherwise all of them could drop before
        // it, and nothing would drop it: the test was flaky, about 1 run in 25).
        if i >= 2 {
            let t = Instant::now();
            while !parked2.load(Ordering::SeqCst) && t.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        b.spec = small_spec();
        b.extras.clear();
        b.extras.push(i as i64);
        let done = Done(tx.lock().unwrap_or_else(|e| e.into_inner()).clone());
        b.pixels = Pixels::Foreign(ForeignBytes::new(DropsTheRun {
            bytes: (0..6).map(|k| (i + k) as u8).collect(),
            hold: h2.clone(),
            done: Some(done),
        }));
        Ok(true)
    });
    let mut run = Dry::new(source, config(2, 2, 2))?;
    for _ in 0..2 {
        run.next().ok_or("ended")??;
    }
    *hold.lock().unwrap_or_else(|e| e.into_inner()) = Some(run);
    parked.store(true, Ordering::SeqCst);
    within("an owner's drop of its own dry run", BOUND, move || {
        // Every owner's drop signals (its `Done` goes); one of them dropped the run.
        let t = Instant::now();
        loop {
            if hold.lock().unwrap_or_else(|e| e.into_inner()).is_none() {
                return Ok(());
            }
            if t.elapsed() > Duration::from_secs(15) {
                return Err(Failed::from("no owner dropped the run"));
            }
            let _ = rx.recv_timeout(Duration::from_millis(10));
        }
    })
}

/// [`foreign_owners_outlive_the_run`] on the GPU prefetcher, whose feeder recycles batches the
/// same way: once `next()` has returned `None`, no owner is alive (before the fix, the last
/// `window` batches' owners lived until the prefetcher was dropped).
fn gpu_foreign_owners_outlive_the_run() -> R {
    within("foreign owners after the end (gpu)", BOUND, || {
        let stream = stream_of(0)?;
        for (iter, loaders, depth, ahead) in [(false, 2, 2, 4), (true, 1, 1, 0)] {
            let base = LIVE_OWNERS.load(Ordering::SeqCst);
            let batch = |i: u64| {
                HostBatch::new(
                    Pixels::Foreign(ForeignBytes::new(Counted::new(
                        (0..6).map(|k| (i + k) as u8).collect(),
                    ))),
                    small_spec(),
                    vec![i as i64],
                )
            };
            let source = if iter {
                Source::iter((0..12).map(move |i| Ok(batch(i))))
            } else {
                Source::new(move |i, b: &mut HostBatch<i64>| {
                    if i >= 12 {
                        return Ok(false);
                    }
                    *b = batch(i);
                    Ok(true)
                })
            };
            let mut p =
                Prefetcher::<f32, i64>::new(&stream, source, config(loaders, depth, ahead))?;
            let mut seen = 0;
            while let Some(b) = p.next() {
                b?;
                seen += 1;
            }
            ensure(seen == 12, || format!("{seen} batches"))?;
            let t = Instant::now();
            while LIVE_OWNERS.load(Ordering::SeqCst) > base && t.elapsed() < Duration::from_secs(2)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            let live = LIVE_OWNERS.load(Ordering::SeqCst) - base;
            drop(p);
            ensure(live == 0, || {
                format!("iter {iter}: {live} owners alive after the last batch")
            })?;
        }
        Ok(())
    })
}

/// `Source::iter_then`: `finish` runs after the turn, so item `i + 1` is pulled while item `i`
/// is being finished: finishing item 0 waits for the iterator to have given item 1 (inside the
/// turn, that would never happen: a hang, caught by `within`). The batches still come in order.
fn iter_then_overlaps() -> R {
    within("iter_then: finish after the turn", BOUND, || {
        let pulled = Arc::new(AtomicU64::new(0));
        let p2 = pulled.clone();
        let iter = (0..12u64).map(move |i| {
            p2.store(i + 1, Ordering::SeqCst);
            Ok(i)
        });
        let source = Source::iter_then(iter, move |i, item: u64, b: &mut HostBatch<i64>| {
            if item != i {
                return Err(format!("turn {i} got item {item}").into());
            }
            if i == 0 {
                while pulled.load(Ordering::SeqCst) < 2 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            // Later items finish in reverse order of their turns.
            std::thread::sleep(Duration::from_millis(12u64.saturating_sub(i)));
            fill_small(b, i);
            Ok(())
        });
        let mut run = Dry::new(source, config(3, 2, 0))?;
        let got = drain(&mut run)?;
        ensure(got.error.is_none(), || format!("{:?}", got.error))?;
        ensure(got.indices == (0..12).collect::<Vec<_>>(), || {
            format!("{:?}", got.indices)
        })
    })
}

/// An error of `finish` is the error of its batch: the batches before it come, then an
/// `Error::Loader` naming it.
fn iter_then_finish_error() -> R {
    let source = Source::iter_then((0..10u64).map(Ok), |i, _, b: &mut HostBatch<i64>| {
        if i == 3 {
            return Err("hostile finish error".into());
        }
        fill_small(b, i);
        Ok(())
    });
    let mut run = Dry::new(source, config(2, 2, 0))?;
    let got = drain(&mut run)?;
    ensure(got.indices == [0, 1, 2], || format!("{:?}", got.indices))?;
    ensure(
        matches!(&got.error, Some(Error::Loader { batch: 3, message }) if message.contains("hostile finish error")),
        || format!("{:?}", got.error),
    )
}

/// A panic in `finish` likewise, caught on the loader thread.
fn iter_then_finish_panic() -> R {
    let source = Source::iter_then((0..10u64).map(Ok), |i, _, b: &mut HostBatch<i64>| {
        if i == 4 {
            panic!("hostile finish panic");
        }
        fill_small(b, i);
        Ok(())
    });
    let mut run = Dry::new(source, config(3, 2, 0))?;
    let got = drain(&mut run)?;
    ensure(got.indices == [0, 1, 2, 3], || format!("{:?}", got.indices))?;
    ensure(
        matches!(&got.error, Some(Error::Loader { batch: 4, .. })),
        || format!("{:?}", got.error),
    )
}
