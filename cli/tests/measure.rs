//! GPU trials of the measurement code behind `pinstream bandwidth` and `staging`: the sweep,
//! its file rows, the peer rows, the cost of pooled pinned memory. Each is marked ignored at run
//! time where the machine has no CUDA device (the two-device ones where it has fewer than two),
//! never passed. The timing primitives they stand on are the library's, tested there.

mod common;

use common::{ensure, R};
use libtest_mimic::{Arguments, Trial};
use pinstream::{Device, Error};

fn main() {
    let mut args = Arguments::from_args();
    // One trial at a time unless asked otherwise: the measurements must not disturb each other.
    args.test_threads.get_or_insert(1);
    let no_gpu = !pinstream::available();
    let two_gpus = Device::count().is_ok_and(|n| n >= 2);
    let mut trials = Vec::new();
    let mut gpu = |name: &str, f: fn() -> R| {
        trials.push(Trial::test(name, f).with_ignored_flag(no_gpu));
    };
    gpu("bandwidth_sweep_small", bandwidth_sweep_small);
    gpu("bandwidth_sweep_chunked", bandwidth_sweep_chunked);
    gpu("bandwidth_file_rows", bandwidth_file_rows);
    gpu("peer/bandwidth_one_device", peer_bandwidth_one_device);
    gpu("bench/pool_cost", pool_cost);
    let mut two = |name: &str, f: fn() -> R| {
        trials.push(Trial::test(name, f).with_ignored_flag(!two_gpus));
    };
    two("peer/bandwidth_small", peer_bandwidth_small);
    two("peer/bandwidth_chunked", peer_bandwidth_chunked);
    libtest_mimic::run(&args, trials).exit();
}

fn dev0() -> Result<Device, Error> {
    Device::get(0)
}

/// Copies issued in pieces (`Options::chunk`) at sizes that do not divide evenly still deliver
/// every byte, and bidir-sum is the per-sample sum of the two loaded directions.
fn bandwidth_sweep_chunked() -> R {
    use pinstream_cli::bench::sweep::{self, Direction, MemKind, Options};
    let dev = dev0()?;
    let opts = Options {
        sizes: vec![(3 << 20) + 5, 1 << 20],
        kinds: vec![MemKind::Pinned, MemKind::Registered],
        directions: vec![Direction::H2D, Direction::D2H, Direction::Bidir],
        chunk: Some(256 << 10),
        ..Options::default()
    };
    let rows = sweep::run(&dev, &opts, &mut |_| {})?;
    ensure(rows.len() == opts.row_count(), || {
        format!("{} rows", rows.len())
    })?;
    for r in &rows {
        ensure(r.verified && r.gbps.samples.len() >= 5, || {
            format!("{} {} {}: {:?}", r.kind, r.direction, r.bytes, r.gbps)
        })?;
    }
    for sum in rows.iter().filter(|r| r.direction == "bidir-sum") {
        let find = |d: &str| {
            rows.iter()
                .find(|r| r.direction == d && r.kind == sum.kind && r.bytes == sum.bytes)
                .ok_or_else(|| format!("no {d} row"))
        };
        let (up, down) = (find("bidir-h2d")?, find("bidir-d2h")?);
        for ((s, u), d) in sum
            .gbps
            .samples
            .iter()
            .zip(&up.gbps.samples)
            .zip(&down.gbps.samples)
        {
            ensure((s - (u + d)).abs() < 1e-9 * s.abs().max(1.0), || {
                format!("sum {s} != {u} + {d}")
            })?;
        }
    }
    Ok(())
}

/// `pinstream bandwidth --file`'s rows: read + copy and upload_file (O_DIRECT where the
/// filesystem of the working directory or /tmp allows it), h2d, host clock, checked, the whole
/// file when it is smaller than asked for.
fn bandwidth_file_rows() -> R {
    use pinstream::{Stager, StagerConfig};
    use pinstream_cli::bench::sweep;
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, StagerConfig::default())?;
    let len = (3 << 20) + 5;
    let data = pinstream_cli::bench::pattern(len)?;
    let mut seen_direct = Vec::new();
    for dir in [std::env::current_dir()?, std::env::temp_dir()] {
        let path = dir.join(format!("pinstream-gpu-file-{}.bin", std::process::id()));
        std::fs::write(&path, &data)?;
        let rows = sweep::file_rows(&stager, &stream, &path, 64 << 20, 3);
        let _ = std::fs::remove_file(&path);
        let rows = rows?;
        let kinds: Vec<&str> = rows.iter().map(|r| r.kind).collect();
        ensure(
            kinds.starts_with(&["file read+copy", "file upload_file"]) && kinds.len() <= 3,
            || format!("{kinds:?}"),
        )?;
        for r in &rows {
            ensure(
                r.verified
                    && r.direction == "h2d"
                    && r.bytes == len
                    && r.gbps.median > 0.0
                    && r.host_gbps.as_ref() == Some(&r.gbps)
                    && r.note.is_some(),
                || format!("{r:?}"),
            )?;
        }
        seen_direct.push(format!("{}: {}", dir.display(), kinds.len() == 3));
    }
    println!("O_DIRECT rows: {}", seen_direct.join("; "));
    Ok(())
}

/// A small bandwidth sweep: every kind and direction, every row verified and plausible, and as
/// many rows as `Options::row_count` promises.
fn bandwidth_sweep_small() -> R {
    use pinstream_cli::bench::sweep::{self, Options};
    let dev = dev0()?;
    let opts = Options {
        sizes: vec![4096, 1 << 20],
        ..Options::default()
    };
    let mut seen = 0;
    let rows = sweep::run(&dev, &opts, &mut |_| seen += 1)?;
    ensure(rows.len() == opts.row_count() && seen == rows.len(), || {
        format!(
            "{} rows, {} promised, {seen} reported",
            rows.len(),
            opts.row_count()
        )
    })?;
    for r in &rows {
        ensure(r.verified, || {
            format!("{} {} {}: data not delivered", r.kind, r.direction, r.bytes)
        })?;
        ensure(
            r.gbps.samples.len() >= 5 && r.gbps.median > 0.01 && r.gbps.median < 10_000.0,
            || format!("{} {} {}: {:?}", r.kind, r.direction, r.bytes, r.gbps),
        )?;
        // The explanation column: host memcpy at the same size, on pageable rows only.
        let memcpy_ok = match r.host_memcpy_gbps {
            Some(m) => r.kind == "pageable" && m > 0.1,
            None => r.kind != "pageable",
        };
        ensure(memcpy_ok, || {
            format!(
                "{} {}: memcpy {:?}",
                r.kind, r.direction, r.host_memcpy_gbps
            )
        })?;
        // Staged rows: host clock (gbps and host_gbps the same samples), the engine in the
        // note, h2d and d2h only.
        let staged = r.kind == "staged";
        ensure(staged == r.note.is_some(), || {
            format!("{} {}: note {:?}", r.kind, r.direction, r.note)
        })?;
        if staged {
            ensure(
                r.note.as_deref().is_some_and(|n| n.contains("threads="))
                    && r.host_gbps.as_ref() == Some(&r.gbps)
                    && (r.direction == "h2d" || r.direction == "d2h"),
                || format!("{r:?}"),
            )?;
        }
    }
    ensure(
        rows.iter().filter(|r| r.kind == "staged").count() == 2 * opts.sizes.len(),
        || "one staged h2d and d2h row per size".into(),
    )?;
    let lat = sweep::latency(&dev, 20)?;
    ensure(
        lat.len() == 4
            && lat
                .iter()
                .all(|l| l.micros.median > 0.1 && l.micros.median < 10_000.0),
        || format!("{lat:?}"),
    )?;
    let pin = sweep::pinning_cost(&dev, 16 << 20, 1)?;
    ensure(
        pin.len() == 3 && pin.iter().all(|p| p.pin_s_per_gib.median > 0.0),
        || format!("{pin:?}"),
    )
}

/// `bench::peer` on one device: no rows, and a note that says p2p needs two.
fn peer_bandwidth_one_device() -> R {
    use pinstream_cli::bench::{peer, sweep::Options};
    let opts = Options {
        sizes: vec![4096],
        ..Options::default()
    };
    let out = peer::run(&[dev0()?], &opts, &mut |_| {})?;
    ensure(
        out.rows.is_empty() && out.notes.len() == 1 && out.notes[0].contains("needs two devices"),
        || format!("{out:?}"),
    )
}

/// Every peer row of a small run: as many as promised, verified, at least 5 samples, plausible,
/// and each p2p-bidir-sum sample above its p2p-bidir sample.
fn peer_bandwidth_check(opts: &pinstream_cli::bench::sweep::Options) -> R {
    use pinstream_cli::bench::peer;
    let devices = [Device::get(0)?, Device::get(1)?];
    let mut seen = 0;
    let out = peer::run(&devices, opts, &mut |_| seen += 1)?;
    println!("notes: {:?}", out.notes);
    let pairs_ok =
        devices[0].can_access_peer(&devices[1])? && devices[1].can_access_peer(&devices[0])?;
    let want = if pairs_ok {
        peer::row_count(2, opts)
    } else {
        0
    };
    ensure(out.rows.len() == want && seen == want, || {
        format!("{} rows, {seen} reported, {want} promised", out.rows.len())
    })?;
    for r in &out.rows {
        println!(
            "{} {} {} {}: {:.2} GB/s ({} per sample)",
            r.device, r.kind, r.direction, r.bytes, r.gbps.median, r.copies_per_sample
        );
        ensure(
            r.verified
                && r.kind == peer::KIND
                && (r.device == "0->1" || r.device == "1->0")
                && peer::DIRECTIONS.contains(&r.direction)
                && r.gbps.samples.len() >= 5
                && r.gbps.median > 0.01
                && r.gbps.median < 10_000.0,
            || format!("{r:?}"),
        )?;
    }
    for sum in out.rows.iter().filter(|r| r.direction == "p2p-bidir-sum") {
        let one = out
            .rows
            .iter()
            .find(|r| r.direction == "p2p-bidir" && r.device == sum.device && r.bytes == sum.bytes)
            .ok_or("no p2p-bidir row")?;
        for (s, o) in sum.gbps.samples.iter().zip(&one.gbps.samples) {
            ensure(s > o, || format!("sum {s} <= one direction {o}"))?;
        }
    }
    Ok(())
}

fn peer_bandwidth_small() -> R {
    peer_bandwidth_check(&pinstream_cli::bench::sweep::Options {
        sizes: vec![4096, (1 << 20) + 7],
        ..Default::default()
    })
}

/// Pieces (`--chunk`) that do not divide the size still deliver every byte.
fn peer_bandwidth_chunked() -> R {
    peer_bandwidth_check(&pinstream_cli::bench::sweep::Options {
        sizes: vec![(3 << 20) + 5],
        chunk: Some(256 << 10),
        ..Default::default()
    })
}

fn pool_cost() -> R {
    let dev = dev0()?;
    for (bytes, threads) in [(1 << 20, 1), (64 << 20, 4)] {
        let c = pinstream_cli::bench::pool::pool_cost(&dev, bytes, threads)?;
        println!("{c:?}");
        let fresh = c.host_alloc_seconds.min(c.register_seconds);
        ensure(
            c.bytes == bytes
                && c.class_bytes >= bytes
                && c.register_threads == threads
                && c.host_alloc_seconds > 0.0
                && c.register_seconds > 0.0
                && c.host_alloc_seconds < 60.0
                && c.register_seconds < 60.0
                && c.cached_us > 0.0
                && c.cached_us <= c.cached_max_us
                && c.cached_hits == c.cached_samples as u64
                && c.cached_samples >= 20,
            || format!("{c:?}"),
        )?;
        // A hit is a lock and a few event queries; a fresh allocation is a system call at least.
        ensure(c.cached_us * 1e-6 < fresh, || {
            format!("a cache hit was no faster than a fresh allocation: {c:?}")
        })?;
    }
    let e = pinstream_cli::bench::pool::pool_cost(&dev, 0, 1).err();
    ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
        format!("zero bytes: {e:?}")
    })?;
    let e = pinstream_cli::bench::pool::pool_cost(&dev, 4096, 0).err();
    ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
        format!("zero threads: {e:?}")
    })
}
