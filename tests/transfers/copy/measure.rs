//! `pinstream::timing` (copy loops, gates, costs and statistics): the trials of `copy` that need
//! the `timing` feature, under the same prefix.

use super::*;

/// The trials of this module, named `copy/...`.
pub fn trials(no_gpu: bool, two_gpus: bool) -> Vec<Trial> {
    let gpu = |name: &str, f: fn() -> R| trial(PREFIX, name, f).with_ignored_flag(no_gpu);
    vec![
        gpu("soundness/gate_from_many_threads", gate_from_many_threads),
        gpu("timing/copy_loop_delivers", copy_loop_delivers),
        gpu("timing/copy_loop_is_ordered", copy_loop_is_ordered),
        gpu("timing/copy_loop_errors", copy_loop_errors),
        gpu("timing/gate_holds_a_copy_loop", gate_holds_a_copy_loop),
        gpu("timing/costs_and_batch", timing_costs_and_batch),
        trial(PREFIX, "peer/copy_loop", peer_copy_loop).with_ignored_flag(!two_gpus),
        // A CPU trial, run everywhere.
        trial(PREFIX, "timing/stats_and_gbps", stats_and_gbps),
    ]
}

/// `timing::Gate` used from several threads at once: each thread closes it on its own stream and
/// opens it; every round finishes (nothing hangs) and data queued behind the gate arrives.
fn gate_from_many_threads() -> R {
    use pinstream::timing::Gate;
    let dev = dev0()?;
    let gate = Gate::new(&dev, Duration::from_secs(2))?;
    let (data, seed) = random_bytes(1 << 16);
    std::thread::scope(|sc| -> R {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                sc.spawn(|| -> Result<(), String> {
                    let s = dev.stream().map_err(|e| e.to_string())?;
                    let src = PinnedBuffer::from_slice(&dev, &data, HostAlloc::DEFAULT)
                        .map_err(|e| e.to_string())?;
                    let mut d =
                        DeviceBuffer::<u8>::new(&dev, data.len()).map_err(|e| e.to_string())?;
                    for _ in 0..20 {
                        gate.close(&s).map_err(|e| e.to_string())?;
                        s.copy_h2d(&src, &mut d).map_err(|e| e.to_string())?;
                        gate.open();
                        let mut back = vec![0u8; data.len()];
                        let got = s
                            .copy_d2h(&d, &mut back[..])
                            .and_then(|p| p.wait().map(|g| g.to_vec()))
                            .map_err(|e| e.to_string())?;
                        if got != data {
                            return Err(format!("data behind the gate differs (seed {seed})"));
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "thread panicked")??;
        }
        Ok(())
    })
}

/// `timing::CopyLoop` through every host kind, both ways and device to device: odd sizes, odd
/// pieces, several copies per batch, and only the first `len` elements touched (the rest keeps
/// its poison).
fn copy_loop_delivers() -> R {
    use pinstream::timing::CopyLoop;
    let dev = dev0()?;
    let stream = dev.stream()?;
    for &(name, kind) in KINDS {
        for (size, piece) in [(4095usize, 1000usize), ((1 << 20) + 13, (64 << 10) + 3)] {
            let what = format!("{name} {size} in pieces of {piece}");
            let (data, seed) = random_bytes(size);
            let len = size - 7;
            let mut d = DeviceBuffer::<u8>::new(&dev, size)?;
            stream.memset(&mut d, 0x5A)?;
            let mut back = vec![0xC3u8; size];
            let check_device = |d: &DeviceBuffer<u8>, what: &str| -> R {
                let mut got = vec![0u8; size];
                stream.copy_d2h(d, &mut got[..])?.wait()?;
                same(what, &got[..len], &data[..len], seed)?;
                ensure(got[len..].iter().all(|&b| b == 0x5A), || {
                    format!("{what}: bytes past len were written")
                })
            };
            match kind {
                Kind::Pageable => {
                    CopyLoop::h2d(&stream, &data[..], &mut d, len)?
                        .pieces(piece)
                        .queue(3)?;
                    check_device(&d, &format!("{what} h2d"))?;
                    CopyLoop::d2h(&stream, &d, &mut back[..], len)?
                        .pieces(piece)
                        .queue(2)?;
                }
                Kind::Pinned(flags) => {
                    let src = PinnedBuffer::from_slice(&dev, &data, flags)?;
                    CopyLoop::h2d(&stream, &src, &mut d, len)?
                        .pieces(piece)
                        .queue(3)?;
                    check_device(&d, &format!("{what} h2d"))?;
                    let mut dst = PinnedBuffer::from_slice(&dev, &back, flags)?;
                    CopyLoop::d2h(&stream, &d, &mut dst, len)?
                        .pieces(piece)
                        .queue(2)?;
                    // Host access waits for the copies through the tracker.
                    back.copy_from_slice(dst.as_slice()?);
                }
                Kind::Registered(flags) => {
                    let mut src = data.clone();
                    Registered::scope(&dev, &mut src, flags, |r| -> R {
                        CopyLoop::h2d(&stream, &*r, &mut d, len)?
                            .pieces(piece)
                            .queue(3)?;
                        Ok(())
                    })??;
                    check_device(&d, &format!("{what} h2d"))?;
                    let mut dst = back.clone();
                    Registered::scope(&dev, &mut dst, flags, |r| -> R {
                        CopyLoop::d2h(&stream, &d, r, len)?.pieces(piece).queue(2)?;
                        Ok(())
                    })??;
                    back = dst;
                }
            }
            same(&format!("{what} d2h"), &back[..len], &data[..len], seed)?;
            ensure(back[len..].iter().all(|&b| b == 0xC3), || {
                format!("{what} d2h: bytes past len were written")
            })?;
        }
    }
    // Device to device, typed: 1000 f32 of 1001.
    let src: Vec<f32> = (0..1001).map(|i| i as f32 + 0.5).collect();
    let mut a = DeviceBuffer::<f32>::new(&dev, 1001)?;
    stream.copy_h2d(&src[..], &mut a)?.wait()?;
    let mut b = DeviceBuffer::<f32>::new(&dev, 1001)?;
    stream.memset(&mut b, 0)?;
    let l = CopyLoop::d2d(&stream, &a, &mut b, 1000)?.pieces(999);
    ensure(l.bytes() == 4000, || format!("bytes {}", l.bytes()))?;
    l.queue(4)?;
    drop(l);
    let mut got = vec![1f32; 1001];
    stream.copy_d2h(&b, &mut got[..])?.wait()?;
    same("d2d f32", &got[..1000], &src[..1000], 0)?;
    ensure(got[1000] == 0.0, || "d2d wrote past len".into())
}

/// A copy loop is ordered like any copy: its destination's earlier write on another stream
/// (behind a slow kernel) comes first, and a read on a third stream waits for the loop.
fn copy_loop_is_ordered() -> R {
    use pinstream::timing::CopyLoop;
    let dev = dev0()?;
    let (s1, s2, s3) = (dev.stream()?, dev.stream()?, dev.stream()?);
    let n = 8 << 20;
    let (data, seed) = random_bytes(n);
    let src = PinnedBuffer::from_slice(&dev, &data, HostAlloc::DEFAULT)?;
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    // s2: a slow kernel, then the destination poisoned: the loop on s1 must land after it.
    s2.spin(Duration::from_millis(100))?;
    s2.memset(&mut d, 0x11)?;
    CopyLoop::h2d(&s1, &src, &mut d, n)?.queue(2)?;
    let mut got = vec![0u8; n];
    s3.copy_d2h(&d, &mut got[..])?.wait()?;
    same("ordered copy loop", &got, &data, seed)
}

/// Typed errors before anything is queued: a length past either side, a destination
/// registered read-only; zero copies and empty copies queue nothing.
fn copy_loop_errors() -> R {
    use pinstream::timing::CopyLoop;
    let dev = dev0()?;
    let stream = dev.stream()?;
    let host = [1u8; 100];
    let mut d = DeviceBuffer::<u8>::new(&dev, 50)?;
    let e = CopyLoop::h2d(&stream, &host[..], &mut d, 51).err();
    ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
        format!("len past the destination: {e:?}")
    })?;
    let mut small = [0u8; 10];
    let e = CopyLoop::d2h(&stream, &d, &mut small[..], 11).err();
    ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
        format!("len past the host destination: {e:?}")
    })?;
    let mut ro = vec![7u8; 4096];
    Registered::scope(&dev, &mut ro, HostRegister::READ_ONLY, |r| -> R {
        let e = CopyLoop::d2h(&stream, &d, r, 10).err();
        ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
            format!("read-only destination: {e:?}")
        })
    })??;
    ensure(ro.iter().all(|&b| b == 7), || {
        "read-only memory written".into()
    })?;
    stream.memset(&mut d, 9)?;
    let l = CopyLoop::h2d(&stream, &host[..], &mut d, 0)?;
    l.queue(5)?;
    let l = CopyLoop::h2d(&stream, &host[..], &mut d, 50)?;
    l.queue(0)?;
    let mut got = [0u8; 50];
    stream.copy_d2h(&d, &mut got[..])?.wait()?;
    ensure(got.iter().all(|&b| b == 9), || {
        "an empty loop or zero copies wrote something".into()
    })
}

/// Copies queued behind a closed gate wait for it: the end event is not reached until the
/// gate opens, and then the data arrives.
fn gate_holds_a_copy_loop() -> R {
    use pinstream::timing::{gbps, CopyLoop, Gate};
    let dev = dev0()?;
    let stream = dev.stream()?;
    let gate = Gate::new(&dev, Duration::from_secs(5))?;
    let n = 4 << 20;
    let (data, seed) = random_bytes(n);
    let src = PinnedBuffer::from_slice(&dev, &data, HostAlloc::DEFAULT)?;
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    let (t0, t1) = (TimingEvent::new(&dev)?, TimingEvent::new(&dev)?);
    {
        let l = CopyLoop::h2d(&stream, &src, &mut d, n)?;
        gate.close(&stream)?;
        stream.record(&t0)?;
        l.queue(8)?;
        stream.record(&t1)?;
        std::thread::sleep(Duration::from_millis(50));
        ensure(!t1.is_complete()?, || {
            "copies ran past a closed gate".into()
        })?;
        ensure(gate.open(), || "the gate timed out".into())?;
        t1.synchronize()?;
        let rate = gbps(8.0 * n as f64, t0.elapsed(&t1)?.as_secs_f64());
        ensure(rate > 0.1 && rate < 10_000.0, || format!("{rate} GB/s"))?;
    }
    let mut got = vec![0u8; n];
    stream.copy_d2h(&d, &mut got[..])?.wait()?;
    same("behind the gate", &got, &data, seed)
}

/// The cost of pinning is measured (and positive), and `batch_h2d_pageable` delivers every
/// tensor or refuses mismatched lengths before queueing anything.
fn timing_costs_and_batch() -> R {
    use pinstream::timing;
    let dev = dev0()?;
    let (alloc, free) = timing::host_alloc_cost(&dev, 16 << 20, HostAlloc::DEFAULT)?;
    let mut data = vec![1u8; 16 << 20];
    let (reg, unreg) = timing::host_register_cost(&dev, &mut data, HostRegister::DEFAULT)?;
    ensure(
        [alloc, free, reg, unreg]
            .iter()
            .all(|t| *t > Duration::ZERO && *t < Duration::from_secs(60)),
        || format!("{alloc:?} {free:?} {reg:?} {unreg:?}"),
    )?;
    let stream = dev.stream()?;
    let srcs: Vec<Vec<u8>> = (0..5).map(|i| random_bytes(1000 + i * 37).0).collect();
    let refs: Vec<&[u8]> = srcs.iter().map(|s| &s[..]).collect();
    let mut dsts = srcs
        .iter()
        .map(|s| DeviceBuffer::<u8>::new(&dev, s.len()))
        .collect::<Result<Vec<_>, _>>()?;
    timing::batch_h2d_pageable(&stream, &refs, &mut dsts)?;
    for (s, d) in srcs.iter().zip(&dsts) {
        let mut got = vec![0u8; s.len()];
        stream.copy_d2h(d, &mut got[..])?.wait()?;
        same("batch_h2d_pageable", &got, s, 0)?;
    }
    let e = timing::batch_h2d_pageable(&stream, &refs[..4], &mut dsts).err();
    ensure(matches!(e, Some(Error::LengthMismatch { .. })), || {
        format!("count mismatch: {e:?}")
    })?;
    let swapped = [refs[1], refs[0]];
    let e = timing::batch_h2d_pageable(&stream, &swapped, &mut dsts[..2]).err();
    ensure(matches!(e, Some(Error::LengthMismatch { .. })), || {
        format!("length mismatch: {e:?}")
    })
}

/// `CopyLoop::peer` both ways, pushed and pulled, in odd pieces; a stream on neither device is
/// `WrongDevice`.
fn peer_copy_loop() -> R {
    use pinstream::timing::CopyLoop;
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    if !(d0.can_access_peer(&d1)? && d1.can_access_peer(&d0)?) {
        println!("no peer access between 0 and 1: nothing to check");
        return Ok(());
    }
    let n = (3 << 20) + 5;
    let (data, seed) = random_bytes(n);
    for (from, to) in [(d0, d1), (d1, d0)] {
        for on_source in [true, false] {
            let (sf, st) = (from.stream()?, to.stream()?);
            let mut a = DeviceBuffer::<u8>::new(&from, n)?;
            sf.copy_h2d(&data[..], &mut a)?.wait()?;
            let mut b = DeviceBuffer::<u8>::new(&to, n)?;
            st.memset(&mut b, 0)?;
            let stream = if on_source { &sf } else { &st };
            CopyLoop::peer(stream, &a, &mut b, n)?
                .pieces(256 << 10)
                .queue(3)?;
            let mut got = vec![0u8; n];
            st.copy_d2h(&b, &mut got[..])?.wait()?;
            same(
                &format!("{}->{} on_source={on_source}", from.ordinal(), to.ordinal()),
                &got,
                &data,
                seed,
            )?;
        }
    }
    if Device::count()? >= 3 {
        let d2 = Device::get(2)?;
        let a = DeviceBuffer::<u8>::new(&d0, 16)?;
        let mut b = DeviceBuffer::<u8>::new(&d1, 16)?;
        let e = CopyLoop::peer(&d2.stream()?, &a, &mut b, 16).err();
        ensure(matches!(e, Some(Error::WrongDevice { .. })), || {
            format!("stream on neither device: {e:?}")
        })?;
    }
    Ok(())
}

/// `timing::Stats` and `timing::gbps`; the process's CPU time only grows.
fn stats_and_gbps() -> R {
    use pinstream::timing::{cpu_seconds, gbps, Stats};
    let s = Stats::new(vec![3.0, 1.0, 2.0, 10.0]).ok_or("no stats")?;
    ensure(s.median == 2.5 && s.min == 1.0 && s.max == 10.0, || {
        format!("{s:?}")
    })?;
    ensure((s.cv - 0.8839).abs() < 1e-3, || format!("cv {}", s.cv))?;
    ensure(s.samples == [3.0, 1.0, 2.0, 10.0], || {
        "samples reordered".into()
    })?;
    ensure(Stats::new(vec![]).is_none(), || "stats of nothing".into())?;
    ensure(
        Stats::new(vec![7.0]).is_some_and(|s| s.median == 7.0 && s.cv == 0.0),
        || "one sample".into(),
    )?;
    ensure(
        Stats::new(vec![0.0, 0.0]).is_some_and(|s| s.cv == 0.0),
        || "zero mean".into(),
    )?;
    ensure(
        (gbps(2e9, 0.5) - 4.0).abs() < 1e-12 && gbps(1.0, 0.0) == 0.0,
        || "gbps".into(),
    )?;
    let before = cpu_seconds();
    let mut x = 0u64;
    for i in 0..20_000_000u64 {
        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
    }
    let after = cpu_seconds();
    ensure(before > 0.0 && after >= before, || {
        format!("cpu seconds {before} then {after} ({x})")
    })
}
