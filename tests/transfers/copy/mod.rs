//! Copies, streams, events and the tracker: GPU trials. Each one is marked ignored at run time
//! when the machine has no CUDA device, so a machine without a GPU reports them as ignored, never
//! as passed.

use std::time::{Duration, Instant};

use crate::common::guard::{Guarded, GUARD};
use crate::common::{ensure, random_bytes, rng, same, R};
use bytemuck::Pod;
use libtest_mimic::Trial;
use pinstream::{
    bf16, f16, kernels, Device, DeviceBuffer, Download, Error, Event, HostAlloc, HostRegister,
    PinnedBuffer, PinnedPool, PoolBacking, PoolBlock, PoolConfig, Registered, Stream, TimingEvent,
};
use rand::Rng;

use crate::common::trial;

#[cfg(feature = "timing")]
mod measure;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "copy/";

#[derive(Clone, Copy, Debug)]
enum Kind {
    Pageable,
    Pinned(HostAlloc),
    Registered(HostRegister),
}

const KINDS: &[(&str, Kind)] = &[
    ("pageable", Kind::Pageable),
    ("pinned-default", Kind::Pinned(HostAlloc::DEFAULT)),
    ("pinned-portable", Kind::Pinned(HostAlloc::PORTABLE)),
    ("pinned-mapped", Kind::Pinned(HostAlloc::MAPPED)),
    (
        "pinned-write-combined",
        Kind::Pinned(HostAlloc::WRITE_COMBINED),
    ),
    (
        "registered-default",
        Kind::Registered(HostRegister::DEFAULT),
    ),
    (
        "registered-portable",
        Kind::Registered(HostRegister::PORTABLE),
    ),
];

const SIZES: &[usize] = &[
    1,
    3,
    4095,
    65_537,
    (1 << 20) + 13,
    (16 << 20) - 7,
    256 << 20,
];

/// A child process started by `failed_wait_leaks` (its CUDA context gets broken on purpose):
/// exits; false in the test runner.
pub fn child_mode() -> bool {
    if let Ok(what) = std::env::var(CHILD_VAR) {
        std::process::exit(child(&what));
    }
    false
}

/// The trials of this module, named `copy/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let two_gpus = Device::count().is_ok_and(|n| n >= 2);
    let mut trials = Vec::new();
    let mut gpu = |name: String, f: fn() -> R| {
        trials.push(trial(PREFIX, name, f).with_ignored_flag(no_gpu));
    };
    gpu("device_info".into(), device_info);
    gpu("typed_roundtrips".into(), typed_roundtrips);
    gpu(
        "views_memset_fill_iota_d2d".into(),
        views_memset_fill_iota_d2d,
    );
    gpu(
        "event_ordering_across_streams".into(),
        event_ordering_across_streams,
    );
    gpu("event_timing".into(), event_timing);
    gpu("stream_priorities".into(), stream_priorities);
    gpu("two_streams_copy_at_once".into(), two_streams_copy_at_once);
    gpu(
        "buffer_used_on_two_streams_is_ordered".into(),
        buffer_used_on_two_streams_is_ordered,
    );
    gpu(
        "tracker/reads_run_beside_each_other".into(),
        reads_run_beside_each_other,
    );
    gpu(
        "tracker/write_waits_for_every_read".into(),
        write_waits_for_every_read,
    );
    gpu(
        "tracker/host_read_beside_gpu_read".into(),
        host_read_beside_gpu_read,
    );
    gpu("tracker/pinned_views".into(), pinned_views);
    gpu(
        "drop_buffers_while_in_flight".into(),
        drop_buffers_while_in_flight,
    );
    gpu("drop_and_forget_pending".into(), drop_and_forget_pending);
    gpu("download/owned_results".into(), download_owned_results);
    gpu(
        "download/poll_before_ready".into(),
        download_poll_before_ready,
    );
    gpu(
        "download/drop_and_forget_unwaited".into(),
        download_drop_and_forget_unwaited,
    );
    gpu(
        "download/into_kept_buffers".into(),
        download_into_kept_buffers,
    );
    gpu(
        "download/ordered_with_writes".into(),
        download_ordered_with_writes,
    );
    gpu("to_vec/buffers_and_views".into(), to_vec_buffers_and_views);
    gpu(
        "async_alloc_across_streams".into(),
        async_alloc_across_streams,
    );
    gpu("threads_share_one_device".into(), threads_share_one_device);
    gpu(
        "errors_are_typed_and_lose_nothing".into(),
        errors_are_typed_and_lose_nothing,
    );
    gpu("registered_read_only".into(), registered_read_only);
    gpu("deliberate_api_errors".into(), deliberate_api_errors);
    gpu(
        "pageable_slice_of_pinned_memory".into(),
        pageable_slice_of_pinned_memory,
    );
    gpu(
        "soundness/pageable_source_free_at_return".into(),
        pageable_source_free_at_return,
    );
    gpu("soundness/over_aligned_types".into(), over_aligned_types);
    gpu(
        "soundness/read_only_as_plain_slice".into(),
        read_only_as_plain_slice,
    );
    // Named `deliberate_fault/...` so that a sanitizer run leaves it out with
    // `--skip deliberate_fault` (see `failed_wait_leaks`).
    gpu(
        "deliberate_fault/failed_wait_leaks".into(),
        failed_wait_leaks,
    );
    for &(name, kind) in KINDS {
        for &size in SIZES {
            trials.push(
                trial(PREFIX, format!("roundtrip/{name}/{size}"), move || {
                    roundtrip(kind, size)
                })
                .with_ignored_flag(no_gpu),
            );
        }
    }
    trials.push(
        trial(PREFIX, "wrong_device_is_an_error", wrong_device_is_an_error)
            .with_ignored_flag(!two_gpus),
    );
    // Copies between devices: one GPU is enough for a same-device pair; the rest needs two
    // (ignored with fewer).
    trials.push(trial(PREFIX, "peer/same_device", peer_same_device).with_ignored_flag(no_gpu));
    for (from, to) in [(0, 1), (1, 0)] {
        for (on, on_source) in [("push", true), ("pull", false)] {
            for &size in PEER_SIZES {
                trials.push(
                    trial(
                        PREFIX,
                        format!("peer/copy/{from}to{to}/{on}/{size}"),
                        move || peer_copy(from, to, on_source, size),
                    )
                    .with_ignored_flag(!two_gpus),
                );
            }
        }
    }
    let mut two = |name: &str, f: fn() -> R| {
        trials.push(trial(PREFIX, name, f).with_ignored_flag(!two_gpus));
    };
    two("peer/typed", peer_typed);
    two("peer/ordered_across_devices", peer_ordered_across_devices);
    two("peer/errors", peer_errors);
    two("peer/stream_ordered_buffers", peer_stream_ordered_buffers);
    two("peer/drop_while_in_flight", peer_drop_while_in_flight);
    #[cfg(feature = "timing")]
    trials.extend(measure::trials(no_gpu, two_gpus));
    trials
}

fn dev0() -> Result<Device, Error> {
    Device::get(0)
}

/// H2D then D2H of random bytes through one kind of host memory, with both the device buffer and
/// the host destination poisoned first.
fn roundtrip(kind: Kind, size: usize) -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let (data, seed) = random_bytes(size);
    let poison: Vec<u8> = data.iter().map(|b| !b).collect();
    let mut d = DeviceBuffer::<u8>::new(&dev, size)?;
    stream.memset(&mut d, 0x5A)?;
    let what = format!("{kind:?} round trip of {size} bytes");
    match kind {
        Kind::Pageable => {
            stream.copy_h2d(&data[..], &mut d)?;
            let mut back = poison;
            let got = stream.copy_d2h(&d, &mut back[..])?.wait()?;
            same(&what, got, &data, seed)
        }
        Kind::Pinned(flags) => {
            let src = PinnedBuffer::from_slice(&dev, &data, flags)?;
            stream.copy_h2d(&src, &mut d)?;
            let mut dst = PinnedBuffer::from_slice(&dev, &poison, flags)?;
            let got = stream.copy_d2h(&d, &mut dst)?.wait()?;
            same(&what, got, &data, seed)
        }
        Kind::Registered(flags) => {
            let mut src = data.clone();
            let mut dst = poison;
            let out = Registered::scope(&dev, &mut src, flags, |rs| -> R {
                Registered::scope(&dev, &mut dst, flags, |rd| -> R {
                    stream.copy_h2d(rs, &mut d)?;
                    let got = stream.copy_d2h(&d, rd)?.wait()?;
                    same(&what, got, &data, seed)
                })?
            })?;
            out?;
            // After the scope: unregistered, and the data is in the caller's vector.
            same(&format!("{what}, after the scope"), &dst, &data, seed)
        }
    }
}

fn typed_roundtrip<T: Pod + PartialEq + std::fmt::Debug>(
    dev: &Device,
    stream: &Stream,
    n: usize,
) -> R {
    let (bytes, seed) = random_bytes(n * std::mem::size_of::<T>());
    let data: Vec<T> = bytemuck::pod_collect_to_vec(&bytes);
    let src = PinnedBuffer::from_slice(dev, &data, HostAlloc::DEFAULT)?;
    let mut d = DeviceBuffer::<T>::new(dev, n)?;
    stream.memset(&mut d, 0xEE)?;
    stream.copy_h2d(&src, &mut d)?;
    let mut dst = PinnedBuffer::<T>::new(dev, n, HostAlloc::DEFAULT)?;
    let got = stream.copy_d2h(&d, &mut dst)?.wait()?;
    // Compare bit patterns: random f32/f16 bytes include NaNs, which never compare equal.
    same(
        &format!("{} x {}", n, std::any::type_name::<T>()),
        bytemuck::cast_slice::<T, u8>(got),
        &bytes,
        seed,
    )
}

fn typed_roundtrips() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    typed_roundtrip::<f32>(&dev, &stream, 1_000_003)?;
    typed_roundtrip::<f16>(&dev, &stream, 4097)?;
    typed_roundtrip::<bf16>(&dev, &stream, 333)?;
    typed_roundtrip::<u64>(&dev, &stream, 7)?;
    typed_roundtrip::<[u8; 3]>(&dev, &stream, 100_001)?;
    Ok(())
}

fn device_info() -> R {
    let n = Device::count()?;
    ensure(n >= 1, || format!("count {n}"))?;
    for dev in Device::all()? {
        let name = dev.name()?;
        let (major, minor) = dev.compute_capability()?;
        let sms = dev.multiprocessor_count()?;
        let mem = dev.total_memory()?;
        let info = dev.memory_info()?;
        let engines = dev.async_engine_count()?;
        let pci = dev.pci_bus_id()?;
        println!(
            "{dev}: {name}, sm_{major}{minor}, {sms} SMs, {mem} bytes ({} free), {engines} copy engines, {pci}, link {:?}, numa {:?}",
            info.free,
            dev.pcie_link(),
            dev.numa_node()
        );
        ensure(!name.is_empty(), || "empty name".into())?;
        ensure(major >= 7, || format!("compute capability {major}.{minor}"))?;
        ensure(sms > 0 && mem > (1 << 30) && info.total == mem, || {
            format!("sms {sms}, total {mem}, memory_info {info:?}")
        })?;
        ensure(info.free <= info.total, || format!("{info:?}"))?;
        ensure(engines >= 1, || format!("{engines} copy engines"))?;
        let parts: Vec<&str> = pci.split([':', '.']).collect();
        ensure(parts.len() == 4 && pci == pci.to_lowercase(), || {
            format!("pci bus id {pci}")
        })?;
    }
    let rt = Device::runtime_version()?;
    let drv = Device::driver_version()?.ok_or("no driver version on a machine with a device")?;
    println!("runtime {rt}, driver {drv}");
    // The runtime is the one this build linked (11.x and 12.x toolkits too); a working device
    // means the driver supports at least that version.
    let built = pinstream::Version::from_cuda(pinstream::CUDART_VERSION as i32);
    ensure(
        rt == built && (drv.major, drv.minor) >= (rt.major, rt.minor),
        || format!("runtime {rt} (built with {built}), driver {drv}"),
    )?;
    // Where the kernel module shows its release, it is read: digits and dots, e.g. 580.159.04.
    let shown = ["/sys/module/nvidia/version", "/proc/driver/nvidia/version"]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    let release = Device::driver_release();
    println!("kernel module {release:?}");
    ensure(
        !shown
            || release.as_deref().is_some_and(|r| {
                r.contains('.') && r.chars().all(|c| c.is_ascii_digit() || c == '.')
            }),
        || format!("kernel module release {release:?}"),
    )
}

fn views_memset_fill_iota_d2d() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 100_003;
    let mut host = PinnedBuffer::<u32>::new(&dev, n, HostAlloc::DEFAULT)?;

    // iota
    let mut a = DeviceBuffer::<u32>::new(&dev, n)?;
    kernels::iota(&s, &mut a, 17, 3)?;
    let want: Vec<u32> = (0..n as u32).map(|i| 17 + 3 * i).collect();
    same("iota", s.copy_d2h(&a, &mut host)?.wait()?, &want, 0)?;

    // fill of every supported width, on odd lengths
    let mut b8 = DeviceBuffer::<u8>::new(&dev, 12_345)?;
    kernels::fill(&s, &mut b8, 0xC3u8)?;
    let mut h8 = vec![0u8; 12_345];
    same(
        "fill u8",
        s.copy_d2h(&b8, &mut h8[..])?.wait()?,
        &vec![0xC3u8; 12_345],
        0,
    )?;
    let mut b16 = DeviceBuffer::<f16>::new(&dev, 777)?;
    kernels::fill(&s, &mut b16, f16::from_f32(-2.5))?;
    let mut h16 = vec![f16::ZERO; 777];
    same(
        "fill f16",
        s.copy_d2h(&b16, &mut h16[..])?.wait()?,
        &vec![f16::from_f32(-2.5); 777],
        0,
    )?;
    let mut b64 = DeviceBuffer::<u64>::new(&dev, 9)?;
    kernels::fill(&s, &mut b64, 0x0123_4567_89AB_CDEFu64)?;
    let mut h64 = [0u64; 9];
    same(
        "fill u64",
        s.copy_d2h(&b64, &mut h64[..])?.wait()?,
        &[0x0123_4567_89AB_CDEFu64; 9],
        0,
    )?;
    ensure(
        matches!(
            kernels::fill(&s, &mut DeviceBuffer::<[u8; 3]>::new(&dev, 4)?, [1, 2, 3]),
            Err(Error::InvalidArgument { .. })
        ),
        || "fill of 3-byte elements must be refused".into(),
    )?;

    // memset of a view leaves the rest alone
    let mut c = DeviceBuffer::<u32>::new(&dev, n)?;
    kernels::fill(&s, &mut c, 0x1111_1111u32)?;
    s.memset(&mut c.slice_mut(10..20)?, 0xFF)?;
    let got = s.copy_d2h(&c, &mut host)?.wait()?;
    let mut want = vec![0x1111_1111u32; n];
    want[10..20].fill(u32::MAX);
    same("memset of a view", got, &want, 0)?;

    // device-to-device, whole and between views
    let mut d = DeviceBuffer::<u32>::new(&dev, n)?;
    s.copy_d2d(&a, &mut d)?;
    let got = s.copy_d2h(&d, &mut host)?.wait()?.to_vec();
    same(
        "d2d",
        &got,
        &(0..n as u32).map(|i| 17 + 3 * i).collect::<Vec<_>>(),
        0,
    )?;
    s.copy_d2d(&a.slice(0..1000)?, &mut d.slice_mut(n - 1000..)?)?;
    let got = s.copy_d2h(&d, &mut host)?.wait()?;
    let mut want: Vec<u32> = (0..n as u32).map(|i| 17 + 3 * i).collect();
    for i in 0..1000 {
        want[n - 1000 + i] = 17 + 3 * i as u32;
    }
    same("d2d between views", got, &want, 0)?;

    // H2D into a view, D2H from a view
    let (bytes, seed) = random_bytes(4 * 513);
    let part: Vec<u32> = bytemuck::pod_collect_to_vec(&bytes);
    s.copy_h2d(&part[..], &mut d.slice_mut(1..514)?)?;
    let mut back = vec![0u32; 513];
    same(
        "h2d into a view",
        s.copy_d2h(&d.slice(1..514)?, &mut back[..])?.wait()?,
        &part,
        seed,
    )?;
    Ok(())
}

fn event_ordering_across_streams() -> R {
    let dev = dev0()?;
    let (a, b) = (dev.stream()?, dev.stream()?);
    let spun = Event::new(&dev)?;
    let after_wait = Event::new(&dev)?;
    let independent = Event::new(&dev)?;

    // Without a wait, b runs on while a spins.
    a.spin(Duration::from_millis(200))?;
    a.record(&spun)?;
    b.record(&independent)?;
    independent.synchronize()?;
    ensure(!spun.is_complete()?, || {
        "a's spin finished before an idle stream's event".into()
    })?;

    // With a wait, b's later work runs after a's.
    b.wait(&spun)?;
    b.record(&after_wait)?;
    ensure(!after_wait.is_complete()?, || {
        "b's event completed before the event it waits for".into()
    })?;
    after_wait.synchronize()?;
    ensure(spun.is_complete()?, || {
        "b passed its wait before a's spin finished".into()
    })?;

    // Timing across the wait: at least the spin.
    let (t0, t1) = (TimingEvent::new(&dev)?, TimingEvent::new(&dev)?);
    a.record(&t0)?;
    a.spin(Duration::from_millis(30))?;
    a.record(&spun)?;
    b.wait(&spun)?;
    b.record(&t1)?;
    t1.synchronize()?;
    let ms = t0.elapsed_ms(&t1)?;
    ensure(ms >= 29.0, || {
        format!("b waited only {ms} ms for a 30 ms spin")
    })
}

fn event_timing() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let (start, end) = (TimingEvent::new(&dev)?, TimingEvent::new(&dev)?);
    s.record(&start)?;
    s.spin(Duration::from_millis(20))?;
    s.record(&end)?;
    let host = Instant::now();
    end.synchronize()?;
    ensure(end.is_complete()?, || {
        "end not complete after synchronize".into()
    })?;
    let ms = start.elapsed_ms(&end)?;
    let d = start.elapsed(&end)?;
    println!(
        "20 ms spin: {ms:.3} ms on the GPU, host waited {:?}",
        host.elapsed()
    );
    ensure((19.5..200.0).contains(&ms), || {
        format!("a 20 ms spin took {ms} ms")
    })?;
    ensure((d.as_secs_f64() * 1e3 - f64::from(ms)).abs() < 0.01, || {
        format!("{d:?} vs {ms} ms")
    })?;
    // Events of two devices, or timing through plain events, cannot be mixed up: the types differ.
    Ok(())
}

fn stream_priorities() -> R {
    let dev = dev0()?;
    let (least, greatest) = dev.stream_priority_range()?;
    let hi = Stream::with_priority(&dev, greatest)?;
    let lo = Stream::with_priority(&dev, least)?;
    ensure(hi.priority() == greatest && lo.priority() == least, || {
        "priorities".into()
    })?;
    let bad = Stream::with_priority(&dev, greatest - 1);
    ensure(matches!(bad, Err(Error::InvalidArgument { .. })), || {
        format!("{bad:?}")
    })?;
    let mut d = DeviceBuffer::<u32>::new(&dev, 1000)?;
    kernels::fill(&hi, &mut d, 9u32)?;
    let mut h = vec![0u32; 1000];
    same(
        "fill on a high-priority stream, read on a low one",
        lo.copy_d2h(&d, &mut h[..])?.wait()?,
        &[9u32; 1000],
        0,
    )?;
    ensure(hi.is_idle()? && lo.is_idle()?, || {
        "streams busy after the wait".into()
    })
}

fn two_streams_copy_at_once() -> R {
    let dev = dev0()?;
    let (up, down) = (dev.stream()?, dev.stream()?);
    let n = 64 << 20;
    let (data_up, seed_up) = random_bytes(n);
    let (data_down, seed_down) = random_bytes(n);
    let src = PinnedBuffer::from_slice(&dev, &data_up, HostAlloc::DEFAULT)?;
    let mut d_up = DeviceBuffer::<u8>::new(&dev, n)?;
    let mut d_down = DeviceBuffer::<u8>::new(&dev, n)?;
    up.copy_h2d(&data_down[..], &mut d_down)?;
    let mut dst = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
    up.synchronize()?;

    // Hold both streams on one event so that both copies start together.
    let gate = Event::new(&dev)?;
    let gate_stream = dev.stream()?;
    gate_stream.spin(Duration::from_millis(20))?;
    gate_stream.record(&gate)?;
    up.wait(&gate)?;
    down.wait(&gate)?;
    let (t0, t1, t2) = (
        TimingEvent::new(&dev)?,
        TimingEvent::new(&dev)?,
        TimingEvent::new(&dev)?,
    );
    up.record(&t0)?;
    let h2d = up.copy_h2d(&src, &mut d_up)?;
    let d2h = down.copy_d2h(&d_down, &mut dst)?;
    up.record(&t1)?;
    down.record(&t2)?;
    let got = d2h.wait()?;
    h2d.wait()?;
    same("d2h while h2d", got, &data_down, seed_down)?;
    let mut back = vec![0u8; n];
    same(
        "h2d while d2h",
        up.copy_d2h(&d_up, &mut back[..])?.wait()?,
        &data_up,
        seed_up,
    )?;
    let (ms_up, ms_down) = (t0.elapsed_ms(&t1)?, t0.elapsed_ms(&t2)?);
    println!(
        "64 MiB each way at once: h2d {:.1} GB/s, d2h {:.1} GB/s",
        n as f64 / ms_up as f64 / 1e6,
        n as f64 / ms_down as f64 / 1e6
    );
    Ok(())
}

/// Writes on one stream and reads on another need no manual event: the buffer orders them.
/// Two copies that only read one buffer, on two streams: the second does not wait for the
/// first (which sits behind a 200 ms spin). Before reads and writes were told apart it did.
fn reads_run_beside_each_other() -> R {
    let dev = dev0()?;
    let (a, b) = (dev.stream()?, dev.stream()?);
    let (data, seed) = random_bytes(3 << 20);
    let src_host = PinnedBuffer::from_slice(&dev, &data, HostAlloc::DEFAULT)?;
    let mut src = DeviceBuffer::<u8>::new(&dev, data.len())?;
    a.copy_h2d(&src_host, &mut src)?;
    a.synchronize()?;
    let (mut d1, mut d2) = (
        DeviceBuffer::<u8>::new(&dev, data.len())?,
        DeviceBuffer::<u8>::new(&dev, data.len())?,
    );
    let (mut h1, mut h2) = (
        PinnedBuffer::<u8>::new(&dev, data.len(), HostAlloc::DEFAULT)?,
        PinnedBuffer::<u8>::new(&dev, data.len(), HostAlloc::DEFAULT)?,
    );
    let a_done = Event::new(&dev)?;
    // Device memory read on two streams, and pinned memory read by two copies.
    a.spin(Duration::from_millis(200))?;
    a.copy_d2d(&src, &mut d1)?;
    a.copy_h2d(&src_host, &mut d1)?;
    a.record(&a_done)?;
    b.copy_d2d(&src, &mut d2)?;
    b.copy_h2d(&src_host, &mut d2)?;
    b.synchronize()?;
    ensure(!a_done.is_complete()?, || {
        "the reads on stream b waited for the reads on stream a".into()
    })?;
    same("b's copy", b.copy_d2h(&d2, &mut h2)?.wait()?, &data, seed)?;
    let got = a.copy_d2h(&d1, &mut h1)?.wait()?;
    same("a's copy", got, &data, seed)
}

/// A write waits for every read queued since the last write, on every stream: a host write to
/// a pinned source and a GPU write to a device source must not overtake reads held back by
/// spins of different lengths.
fn write_waits_for_every_read() -> R {
    let dev = dev0()?;
    let (a, b, c) = (dev.stream()?, dev.stream()?, dev.stream()?);
    let n = 2 << 20;
    let (old, seed) = random_bytes(n);
    let mut host = PinnedBuffer::from_slice(&dev, &old, HostAlloc::DEFAULT)?;
    let mut dev_src = DeviceBuffer::<u8>::new(&dev, n)?;
    c.copy_h2d(&host, &mut dev_src)?;
    let mut outs = (0..4)
        .map(|_| DeviceBuffer::<u8>::new(&dev, n))
        .collect::<pinstream::Result<Vec<_>>>()?;
    let (o1, rest) = outs.split_at_mut(1);
    let (o2, rest) = rest.split_at_mut(1);
    let (o3, o4) = rest.split_at_mut(1);
    a.spin(Duration::from_millis(150))?;
    a.copy_h2d(&host, &mut o1[0])?;
    a.copy_d2d(&dev_src, &mut o3[0])?;
    b.spin(Duration::from_millis(60))?;
    b.copy_h2d(&host, &mut o2[0])?;
    b.copy_d2d(&dev_src, &mut o4[0])?;
    // The writes: on the host (waits for both pinned reads) and on a third stream.
    host.as_mut_slice()?.fill(0xA5);
    kernels::fill(&c, &mut dev_src, 0x5Au8)?;
    let mut back = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
    for (what, o) in [("a", &o1[0]), ("b", &o2[0])] {
        let got = c.copy_d2h(o, &mut back)?.wait()?;
        same(&format!("pinned read on {what}"), got, &old, seed)?;
    }
    for (what, o) in [("a", &o3[0]), ("b", &o4[0])] {
        let got = c.copy_d2h(o, &mut back)?.wait()?;
        same(&format!("device read on {what}"), got, &old, seed)?;
    }
    let got = c.copy_d2h(&dev_src, &mut back)?.wait()?;
    ensure(got.iter().all(|&v| v == 0x5A), || {
        "the write after the reads did not land".into()
    })
}

/// Host reads of pinned memory run beside a GPU copy that reads it (no wait), but wait for one
/// that writes it.
fn host_read_beside_gpu_read() -> R {
    let dev = dev0()?;
    let a = dev.stream()?;
    let (data, seed) = random_bytes(1 << 20);
    let mut host = PinnedBuffer::from_slice(&dev, &data, HostAlloc::DEFAULT)?;
    let mut d = DeviceBuffer::<u8>::new(&dev, data.len())?;
    let done = Event::new(&dev)?;
    a.spin(Duration::from_millis(200))?;
    a.copy_h2d(&host, &mut d)?;
    a.record(&done)?;
    same("host read during a GPU read", host.as_slice()?, &data, seed)?;
    ensure(!done.is_complete()?, || {
        "as_slice waited for a copy that only reads the buffer".into()
    })?;
    // A write into it: as_slice waits for that.
    kernels::fill(&a, &mut d, 7u8)?;
    a.spin(Duration::from_millis(100))?;
    let pending = a.copy_d2h(&d, &mut host)?;
    drop(pending);
    ensure(host.as_slice()?.iter().all(|&v| v == 7), || {
        "as_slice did not wait for the copy that writes the buffer".into()
    })
}

/// `PinnedBuffer::slice`: copies read only the range; ranges outside are typed errors.
fn pinned_views() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let (data, seed) = random_bytes(70_001);
    let host = PinnedBuffer::from_slice(&dev, &data, HostAlloc::PORTABLE)?;
    let mut back = vec![0u8; 0];
    for (lo, hi) in [
        (0usize, 70_001usize),
        (13, 4_109),
        (65_536, 70_001),
        (500, 500),
    ] {
        let view = host.slice(lo..hi)?;
        ensure(view.len() == hi - lo, || {
            format!("view {lo}..{hi} has length {}", view.len())
        })?;
        same(
            &format!("view {lo}..{hi} on the host"),
            view.as_slice()?,
            &data[lo..hi],
            seed,
        )?;
        let mut d = DeviceBuffer::<u8>::new(&dev, hi - lo)?;
        kernels::fill(&s, &mut d, 0xEEu8)?;
        s.copy_h2d(&view, &mut d)?;
        back.resize(hi - lo, 0);
        s.copy_d2h(&d, &mut back[..])?.wait()?;
        same(
            &format!("copy of view {lo}..{hi}"),
            &back,
            &data[lo..hi],
            seed,
        )?;
    }
    for (lo, hi) in [
        (0usize, 70_002usize),
        (70_000, 70_002),
        (usize::MAX, usize::MAX),
    ] {
        let r = host.slice(lo..hi);
        ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
            format!("slice {lo}..{hi} of 70001: {r:?}")
        })?;
    }
    let (hi, lo) = (3usize, 5usize);
    let r = host.slice(lo..hi);
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("slice 5..3: {r:?}")
    })
}

fn buffer_used_on_two_streams_is_ordered() -> R {
    let dev = dev0()?;
    let (a, b) = (dev.stream()?, dev.stream()?);
    let n = 4 << 20;
    let mut d = DeviceBuffer::<u32>::new(&dev, n)?;
    let mut host = PinnedBuffer::<u32>::new(&dev, n, HostAlloc::DEFAULT)?;
    for round in 1..=5u32 {
        a.spin(Duration::from_millis(10))?;
        kernels::fill(&a, &mut d, round)?;
        let got = b.copy_d2h(&d, &mut host)?.wait()?;
        ensure(got.iter().all(|&v| v == round), || {
            format!(
                "round {round}: read on stream b saw {} before a's fill",
                got[0]
            )
        })?;
    }
    Ok(())
}

fn drop_buffers_while_in_flight() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 32 << 20;
    let (data, seed) = random_bytes(n);
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    {
        let src = PinnedBuffer::from_slice(&dev, &data, HostAlloc::DEFAULT)?;
        s.spin(Duration::from_millis(30))?;
        s.copy_h2d(&src, &mut d)?;
        // `src` is dropped here with its copy still queued behind the spin: Drop waits.
    }
    let mut back = vec![0u8; n];
    same(
        "after dropping the pinned source",
        s.copy_d2h(&d, &mut back[..])?.wait()?,
        &data,
        seed,
    )?;

    // A device buffer dropped while a copy into it waits behind a spin.
    {
        let mut d2 = DeviceBuffer::<u8>::new(&dev, n)?;
        s.spin(Duration::from_millis(30))?;
        s.copy_d2d(&d, &mut d2)?;
    }
    // A stream dropped while its work is queued; the buffers outlive it.
    {
        let s2 = dev.stream()?;
        s2.spin(Duration::from_millis(30))?;
        kernels::fill(&s2, &mut d, 0x42u8)?;
    }
    let got = s.copy_d2h(&d, &mut back[..])?.wait()?;
    ensure(got.iter().all(|&b| b == 0x42), || {
        "fill on a dropped stream lost".into()
    })?;
    // Registered memory whose scope ends with a copy still queued.
    let mut reg = data.clone();
    Registered::scope(&dev, &mut reg, HostRegister::DEFAULT, |r| -> R {
        s.spin(Duration::from_millis(30))?;
        s.copy_h2d(r, &mut d)?;
        Ok(())
    })??;
    let got = s.copy_d2h(&d, &mut back[..])?.wait()?;
    same(
        "h2d from registered memory, scope ended in flight",
        got,
        &data,
        seed,
    )
}

fn drop_and_forget_pending() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 16 << 20;
    let (data, seed) = random_bytes(n);
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    s.copy_h2d(&data[..], &mut d)?;
    let poison: Vec<u8> = data.iter().map(|b| !b).collect();

    // is_ready is false behind a spin, then wait gives the data.
    let mut dst = PinnedBuffer::from_slice(&dev, &poison, HostAlloc::DEFAULT)?;
    s.spin(Duration::from_millis(50))?;
    let p = s.copy_d2h(&d, &mut dst)?;
    ensure(!p.is_ready()?, || {
        "pending copy ready behind a 50 ms spin".into()
    })?;
    same("wait", p.wait()?, &data, seed)?;

    // Dropped without waiting: the drop waits.
    let mut dst = PinnedBuffer::from_slice(&dev, &poison, HostAlloc::DEFAULT)?;
    s.spin(Duration::from_millis(30))?;
    drop(s.copy_d2h(&d, &mut dst)?);
    same("after dropping a Pending", dst.as_slice()?, &data, seed)?;

    // Leaked: the pinned buffer's own event still makes host access wait.
    let mut dst = PinnedBuffer::from_slice(&dev, &poison, HostAlloc::DEFAULT)?;
    s.spin(Duration::from_millis(30))?;
    std::mem::forget(s.copy_d2h(&d, &mut dst)?);
    same("after forgetting a Pending", dst.as_slice()?, &data, seed)?;

    // Leaked into registered memory: the end of the scope waits.
    let mut dst = poison.clone();
    Registered::scope(&dev, &mut dst, HostRegister::DEFAULT, |r| -> R {
        s.spin(Duration::from_millis(30))?;
        std::mem::forget(s.copy_d2h(&d, r)?);
        same(
            "registered, forgotten Pending, as_slice",
            r.as_slice()?,
            &data,
            seed,
        )
    })??;
    same(
        "registered, forgotten Pending, after the scope",
        &dst,
        &data,
        seed,
    )
}

fn async_alloc_across_streams() -> R {
    let dev = dev0()?;
    let (a, b) = (dev.stream()?, dev.stream()?);
    let n = 8 << 20;
    let (data, seed) = random_bytes(n);
    let mut back = vec![0u8; n];
    for _ in 0..10 {
        // Allocated on a (behind a spin), used on b, dropped (freed on a after b's use).
        a.spin(Duration::from_millis(5))?;
        let mut buf = DeviceBuffer::<u8>::new_async(&a, n)?;
        b.copy_h2d(&data[..], &mut buf)?;
        let got = b.copy_d2h(&buf, &mut back[..])?.wait()?;
        same(
            "stream-ordered buffer used on another stream",
            got,
            &data,
            seed,
        )?;
    }
    // The allocating stream handle goes away before the buffer.
    let c = dev.stream()?;
    let mut buf = DeviceBuffer::<u8>::new_async(&c, n)?;
    drop(c);
    kernels::fill(&b, &mut buf, 7u8)?;
    let got = b.copy_d2h(&buf, &mut back[..])?.wait()?;
    ensure(got.iter().all(|&v| v == 7), || {
        "fill of a stream-ordered buffer".into()
    })?;
    drop(buf);
    let empty = DeviceBuffer::<u8>::new_async(&b, 0)?;
    ensure(empty.is_empty(), || "empty".into())
}

fn threads_share_one_device() -> R {
    let dev = dev0()?;
    let n = 4 << 20;
    let (data, seed) = random_bytes(n);
    let shared = {
        let s = dev.stream()?;
        let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
        s.copy_h2d(&data[..], &mut d)?;
        d
    };
    let results: Vec<R> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let (shared, data) = (&shared, &data);
                scope.spawn(move || -> R {
                    let s = dev.stream()?;
                    let mut own = DeviceBuffer::<u8>::new(&dev, n)?;
                    let mut host = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
                    for i in 0..10u8 {
                        // Everyone reads the shared buffer...
                        same(
                            "shared read",
                            s.copy_d2h(shared, &mut host)?.wait()?,
                            data,
                            seed,
                        )?;
                        // ...and round-trips its own data.
                        let v = t as u8 * 16 + i + 1;
                        host.as_mut_slice()?.fill(v);
                        s.copy_h2d(&host, &mut own)?;
                        host.as_mut_slice()?.fill(0);
                        let got = s.copy_d2h(&own, &mut host)?.wait()?;
                        ensure(got.iter().all(|&b| b == v), || {
                            format!("thread {t} round {i}")
                        })?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
            .collect()
    });
    results.into_iter().collect()
}

fn errors_are_typed_and_lose_nothing() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 1000;
    let (data, seed) = random_bytes(n);
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    s.copy_h2d(&data[..], &mut d)?;

    let long = vec![1u8; n + 1];
    let e = s.copy_h2d(&long[..], &mut d).err();
    ensure(
        matches!(
            e,
            Some(Error::LengthMismatch {
                src: 1001,
                dst: 1000,
                ..
            })
        ),
        || format!("{e:?}"),
    )?;
    let mut short = vec![9u8; n - 1];
    let e = s.copy_d2h(&d, &mut short[..]).err();
    ensure(matches!(e, Some(Error::LengthMismatch { .. })), || {
        format!("{e:?}")
    })?;
    ensure(short.iter().all(|&b| b == 9), || {
        "refused copy wrote the destination".into()
    })?;
    let mut other = DeviceBuffer::<u8>::new(&dev, n + 5)?;
    let e = s.copy_d2d(&d, &mut other).err();
    ensure(matches!(e, Some(Error::LengthMismatch { .. })), || {
        format!("{e:?}")
    })?;
    let mut back = vec![0u8; n];
    same(
        "after refused copies",
        s.copy_d2h(&d, &mut back[..])?.wait()?,
        &data,
        seed,
    )?;

    let e = DeviceBuffer::<u64>::new(&dev, usize::MAX).err();
    ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
        format!("{e:?}")
    })?;
    let e = Device::get(Device::count()?).err();
    ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
        format!("{e:?}")
    })?;
    let e = d.slice(5..n + 1).err();
    ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
        format!("{e:?}")
    })?;
    #[allow(clippy::reversed_empty_ranges)]
    let e = d.slice(7..3).err();
    ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
        format!("{e:?}")
    })?;

    // The context still works after all of that.
    same(
        "after errors",
        s.copy_d2h(&d, &mut back[..])?.wait()?,
        &data,
        seed,
    )?;
    let (mut rng, _) = rng();
    let k: u32 = rng.random_range(1..1000);
    let mut z = DeviceBuffer::<u32>::new(&dev, 10)?;
    kernels::fill(&s, &mut z, k)?;
    let mut h = [0u32; 10];
    let got = s.copy_d2h(&z, &mut h[..])?.wait()?;
    same("kernel after errors", got, &[k; 10], 0)
}

/// Errors that the CUDA runtime itself reports, on purpose. compute-sanitizer lists each such
/// API error; this is the only trial that makes them (see BENCHMARKS.md for how it is run).
fn deliberate_api_errors() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let e = DeviceBuffer::<u8>::new(&dev, 1 << 50).err();
    ensure(
        matches!(e, Some(Error::OutOfMemory { bytes, .. }) if bytes == 1 << 50),
        || format!("{e:?}"),
    )?;
    println!("{}", e.map(|e| e.to_string()).unwrap_or_default());
    // Timing before either event was recorded is an error, not garbage.
    let (start, end) = (TimingEvent::new(&dev)?, TimingEvent::new(&dev)?);
    let e = start.elapsed_ms(&end).err();
    ensure(matches!(e, Some(Error::Cuda { .. })), || format!("{e:?}"))?;
    // The reported errors do not resurface in the next launch's check.
    let mut d = DeviceBuffer::<u32>::new(&dev, 100)?;
    kernels::fill(&s, &mut d, 5u32)?;
    let mut h = [0u32; 100];
    let got = s.copy_d2h(&d, &mut h[..])?.wait()?;
    same("fill after API errors", got, &[5u32; 100], 0)
}

fn registered_read_only() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 1 << 20;
    let (data, seed) = random_bytes(n);
    let mut src = data.clone();
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    let r = Registered::scope(&dev, &mut src, HostRegister::READ_ONLY, |r| -> R {
        s.copy_h2d(r, &mut d)?;
        let e = s.copy_d2h(&d, r).err();
        ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
            format!("{e:?}")
        })
    });
    match r {
        Ok(inner) => inner?,
        // Some platforms do not support read-only registration: that must be an error value.
        Err(e) => {
            println!("read-only registration refused: {e}");
            return Ok(());
        }
    }
    let mut back = vec![0u8; n];
    let got = s.copy_d2h(&d, &mut back[..])?.wait()?;
    same("h2d from read-only registered memory", got, &data, seed)
}

/// A plain slice that is in fact pinned memory is still handled safely.
fn pageable_slice_of_pinned_memory() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 8 << 20;
    let (data, seed) = random_bytes(n);
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    let mut pinned = PinnedBuffer::from_slice(&dev, &data, HostAlloc::DEFAULT)?;
    s.spin(Duration::from_millis(20))?;
    s.copy_h2d(pinned.as_slice()?, &mut d)?;
    // The copy is finished when the call returns, so overwriting now cannot change what arrived.
    pinned.as_mut_slice()?.fill(0);
    let mut back = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
    s.spin(Duration::from_millis(20))?;
    let got = s.copy_d2h(&d, back.as_mut_slice()?)?.wait()?;
    same("pinned memory passed as plain slices", got, &data, seed)
}

fn wrong_device_is_an_error() -> R {
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    let s0 = d0.stream()?;
    let mut b1 = DeviceBuffer::<u8>::new(&d1, 16)?;
    let src = [1u8; 16];
    let e = s0.copy_h2d(&src[..], &mut b1).err();
    ensure(
        matches!(
            e,
            Some(Error::WrongDevice {
                expected: 0,
                found: 1,
                ..
            })
        ),
        || format!("{e:?}"),
    )?;
    let ev1 = Event::new(&d1)?;
    let e = s0.record(&ev1).err();
    ensure(matches!(e, Some(Error::WrongDevice { .. })), || {
        format!("{e:?}")
    })
}

/// A plain source slice may be changed the moment `copy_h2d` returns, whatever the GPU is doing:
/// small ones (bounce blocks) return without waiting for the busy stream, larger ones return
/// with the copy finished. Then the source is scribbled over; the device must hold the original.
fn pageable_source_free_at_return() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    for size in [1usize, 4097, 65_536, 1 << 20, (1 << 20) + 1, 8 << 20] {
        let (data, seed) = random_bytes(size);
        let mut src = data.clone();
        let mut d = DeviceBuffer::<u8>::new(&dev, size)?;
        // Warm-up: the first copy of a size class may allocate its pinned block.
        s.copy_h2d(&src[..], &mut d)?;
        s.synchronize()?;
        s.memset(&mut d, 0x5A)?;
        s.spin(Duration::from_millis(100))?;
        let t = Instant::now();
        let in_flight = s.copy_h2d(&src[..], &mut d)?;
        let took = t.elapsed();
        if size <= 1 << 20 {
            // A state check, not a clock: the 100 ms spin still runs when the call returns.
            ensure(!s.is_idle()?, || {
                format!("a {size}-byte pageable copy waited {took:?} for the busy stream")
            })?;
        } else {
            ensure(in_flight.is_complete()?, || {
                format!("a {size}-byte pageable copy returned before it had finished")
            })?;
        }
        drop(in_flight);
        for b in src.iter_mut() {
            *b = !*b;
        }
        drop(src);
        let mut back = vec![0u8; size];
        let got = s.copy_d2h(&d, &mut back[..])?.wait()?;
        same(
            &format!("{size} bytes from a plain slice"),
            got,
            &data,
            seed,
        )?;
    }
    Ok(())
}

#[repr(C, align(65536))]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
struct Aligned64K([[u8; 4096]; 16]);

#[repr(C, align(512))]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
struct Aligned512([u32; 128]);

/// Types aligned beyond what the allocators promise: pinned buffers hand out aligned slices
/// (never a misaligned `&[T]`), device buffers are aligned or refused with a typed error, and
/// the data survives a round trip.
fn over_aligned_types() -> R {
    fn check<T: Pod + PartialEq + std::fmt::Debug>(dev: &Device, s: &Stream, len: usize) -> R {
        let align = std::mem::align_of::<T>();
        let bytes = len * std::mem::size_of::<T>();
        let (data, seed) = random_bytes(bytes);
        for flags in [
            HostAlloc::DEFAULT,
            HostAlloc::MAPPED,
            HostAlloc::WRITE_COMBINED,
        ] {
            let mut host = PinnedBuffer::<T>::new(dev, len, flags)?;
            let p = host.as_slice()?.as_ptr() as usize;
            ensure(p % align == 0, || {
                format!("PinnedBuffer<{align}-aligned> x {len} ({flags:?}) at {p:#x}")
            })?;
            bytemuck::cast_slice_mut::<T, u8>(host.as_mut_slice()?).copy_from_slice(&data);
            let mut d = match DeviceBuffer::<T>::new(dev, len) {
                Ok(d) => d,
                Err(Error::InvalidArgument { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            let dp = d.as_device_ptr() as usize;
            ensure(dp % align == 0, || format!("DeviceBuffer at {dp:#x}"))?;
            s.copy_h2d(&host, &mut d)?;
            let mut back = vec![T::zeroed(); len];
            let got = s.copy_d2h(&d, &mut back[..])?.wait()?;
            same(
                &format!("{align}-aligned round trip"),
                bytemuck::cast_slice::<T, u8>(got),
                &data,
                seed,
            )?;
        }
        Ok(())
    }
    let dev = dev0()?;
    let s = dev.stream()?;
    for len in [1, 2, 3, 5] {
        check::<Aligned64K>(&dev, &s, len)?;
        check::<Aligned512>(&dev, &s, len)?;
    }
    Ok(())
}

/// A read-only registration handed out as a plain slice (`as_mut_slice`) is refused as a
/// device-to-host destination with the crate's own error, before anything is queued, whole or
/// in part; after the scope the same memory is an ordinary destination again.
fn read_only_as_plain_slice() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 1 << 16;
    let (data, seed) = random_bytes(n);
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    s.copy_h2d(&data[..], &mut d)?;
    let mut host = vec![0x77u8; n];
    let inner = Registered::scope(&dev, &mut host, HostRegister::READ_ONLY, |r| -> R {
        let plain = r.as_mut_slice()?;
        let e = s.copy_d2h(&d, &mut plain[..]).err();
        ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
            format!("whole read-only slice: {e:?}")
        })?;
        // Memory outside the registration is an ordinary destination.
        let mut other = [0u8; 100];
        let got = s.copy_d2h(&d.slice(..100)?, &mut other[..])?.wait()?;
        same("outside the read-only range", got, &data[..100], seed)?;
        let part = d.slice(..64)?;
        let e = s.copy_d2h(&part, &mut plain[1000..1064]).err();
        ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
            format!("part of a read-only slice: {e:?}")
        })?;
        ensure(plain.iter().all(|&b| b == 0x77), || {
            "a refused copy wrote the read-only memory".into()
        })
    });
    match inner {
        Ok(inner) => inner?,
        Err(e) => {
            println!("read-only registration refused: {e}");
            return Ok(());
        }
    }
    let got = s.copy_d2h(&d, &mut host[..])?.wait()?;
    same("after the read-only scope", got, &data, seed)
}

const CHILD_VAR: &str = "PINSTREAM_GPU_TEST_CHILD";

/// After a wait for the GPU fails (here: a kernel faults, which breaks the CUDA context), the
/// memory that work was queued on is leaked and counted, never freed or unregistered under a
/// DMA. Runs in a child process, whose context is broken on purpose.
///
/// The trial is `deliberate_fault/failed_wait_leaks`: its fault is deliberate, and under
/// compute-sanitizer it produces about 227 000 expected memcheck reports. Leave it out of a
/// sanitizer run by its prefix:
///
/// ```sh
/// compute-sanitizer --tool memcheck --report-api-errors no .gpu/test/transfers-* --skip deliberate_fault
/// ```
fn failed_wait_leaks() -> R {
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(exe)
        .env(CHILD_VAR, "sticky")
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    ensure(out.status.success(), || {
        format!("child failed ({}): {text}", out.status)
    })
}

fn child(what: &str) -> i32 {
    let r = match what {
        "sticky" => sticky_child(),
        _ => Err(format!("unknown child {what}").into()),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            println!("child: {e:?}");
            1
        }
    }
}

fn sticky_child() -> R {
    use pinstream::memory::leaked;
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 1 << 20;
    let mut pinned = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
    pinned.as_mut_slice()?.fill(3);
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    let mut d2 = DeviceBuffer::<u8>::new_async(&s, n)?;
    let mut owned = vec![7u8; n];
    let before = leaked();
    // Hold the stream, so that everything below is queued before the fault happens.
    s.spin(Duration::from_millis(300))?;
    // SAFETY: deliberately not: 0x1000 is no device memory, so this kernel faults and breaks the
    // context. That is the point of this child process, which does nothing else afterwards.
    let err =
        unsafe { pinstream::sys::pinstream_fill(0x1000 as *mut _, 1 << 20, 4, 0, s.as_raw()) };
    ensure(err == pinstream::sys::cudaError::cudaSuccess, || {
        format!("launch of the faulting kernel: {err:?}")
    })?;
    s.copy_h2d(&pinned, &mut d)?;
    s.copy_d2d(&d, &mut d2)?;
    let scoped = Registered::scope(&dev, &mut owned, HostRegister::DEFAULT, |r| {
        s.copy_h2d(r, &mut d).map(|_| ())
    });
    println!("scope: {scoped:?}");
    ensure(scoped.is_err(), || {
        "the scope did not report the failed wait".into()
    })?;
    // The copy only read `pinned`: a host write must wait for it, and that wait fails. (A host
    // read needs only the last write, of which there was none on the GPU: harmless either way.)
    let e = pinned.as_mut_slice().err();
    ensure(e.is_some(), || "host write after a failed wait".into())?;
    drop(pinned);
    drop(d);
    drop(d2);
    let after = leaked();
    println!("leaked before {before:?}, after {after:?}");
    // The pinned buffer, both device buffers and the registration.
    ensure(after.allocations - before.allocations >= 4, || {
        format!(
            "expected 4 leaks, counted {}",
            after.allocations - before.allocations
        )
    })?;
    ensure(after.bytes - before.bytes >= 4 * n as u64, || {
        format!("leaked only {} bytes", after.bytes - before.bytes)
    })
}

/// Byte counts for the peer copies: none a multiple of anything but 1.
const PEER_SIZES: &[usize] = &[
    1,
    3,
    4095,
    65_537,
    (1 << 20) + 13,
    (16 << 20) - 7,
    (96 << 20) + 5,
];

/// Fresh random bytes from a view at an odd offset of a buffer on device `from` into a view of a
/// buffer on device `to` between poisoned guard bytes, the copy queued on a stream of the source
/// (`on_source`: it pushes) or of the destination (it pulls). The data goes up on one stream,
/// the poison on another, the copy on a third and the read-back on the second: nothing but the
/// trackers orders them.
fn peer_copy(from: usize, to: usize, on_source: bool, size: usize) -> R {
    let (da, db) = (Device::get(from)?, Device::get(to)?);
    let (sa, sb) = (da.stream()?, db.stream()?);
    let (data, seed) = random_bytes(size);
    let mut src = DeviceBuffer::<u8>::new(&da, size + 16)?;
    sa.copy_h2d(&data[..], &mut src.slice_mut(7..7 + size)?)?;
    let mut dst = Guarded::<u8>::new(&sb, GUARD + 1, size, GUARD + 3, 0x5A)?;
    let on = if on_source {
        da.stream()?
    } else {
        db.stream()?
    };
    on.copy_peer(&src.slice(7..7 + size)?, &mut dst.view_mut()?)?;
    let what = format!(
        "peer copy of {size} bytes, {from} to {to}, on a stream of {}",
        on.device().ordinal()
    );
    let got = dst.read_checked(&sb, &what)?;
    same(&what, &got, &data, seed)
}

/// Elements wider than a byte, odd counts, both directions.
fn peer_typed() -> R {
    fn one<T: Pod + PartialEq + std::fmt::Debug>(a: &Device, b: &Device, n: usize) -> R {
        let (bytes, seed) = random_bytes(n * std::mem::size_of::<T>());
        let data: Vec<T> = bytemuck::pod_collect_to_vec(&bytes);
        let (sa, sb) = (a.stream()?, b.stream()?);
        let mut src = DeviceBuffer::<T>::new(a, n)?;
        sa.copy_h2d(&data[..], &mut src)?;
        let mut dst = DeviceBuffer::<T>::new(b, n)?;
        sb.memset(&mut dst, 0xEE)?;
        sb.copy_peer(&src, &mut dst)?;
        let mut back = vec![T::zeroed(); n];
        let got = sa.copy_d2h(&dst.slice(..)?, &mut back[..]);
        // `dst` lives on `b`: reading it on `a`'s stream is a wrong-device error; read it on b.
        ensure(matches!(got, Err(Error::WrongDevice { .. })), || {
            format!(
                "d2h of device {}'s buffer on device {}'s stream: {:?}",
                b.ordinal(),
                a.ordinal(),
                got.err()
            )
        })?;
        let got = sb.copy_d2h(&dst, &mut back[..])?.wait()?;
        same(
            &format!(
                "{n} x {} from {} to {}",
                std::any::type_name::<T>(),
                a.ordinal(),
                b.ordinal()
            ),
            bytemuck::cast_slice::<T, u8>(got),
            &bytes,
            seed,
        )
    }
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    for (a, b) in [(d0, d1), (d1, d0)] {
        one::<f16>(&a, &b, 100_003)?;
        one::<u64>(&a, &b, 12_347)?;
        one::<[u8; 3]>(&a, &b, 777)?;
    }
    Ok(())
}

/// A peer copy is ordered after every earlier use of both buffers and before every later one,
/// on any stream of either device: the source written by a memset queued behind a slow kernel
/// on the source's device (the copy must see it), the destination written behind a slow kernel
/// on another stream of its device (the copy must land after it), the source overwritten right
/// after the copy was queued (the copy, itself held back, must still read the old value), and
/// the destination read back on yet another stream.
fn peer_ordered_across_devices() -> R {
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    let (s0, s0b, s1, s1b) = (d0.stream()?, d0.stream()?, d1.stream()?, d1.stream()?);
    let n = (8 << 20) + 3;
    let mut src = DeviceBuffer::<u8>::new(&d0, n)?;
    let mut dst = DeviceBuffer::<u8>::new(&d1, n)?;
    let mut host = PinnedBuffer::<u8>::new(&d1, n, HostAlloc::DEFAULT)?;
    for round in 1..=6u8 {
        let (want, later) = (round, round + 100);
        s0.spin(Duration::from_millis(20))?;
        s0.memset(&mut src, want)?;
        s1b.spin(Duration::from_millis(20))?;
        s1b.memset(&mut dst, 0xEE)?;
        // Pull (a stream of the destination) in odd rounds, push in even ones.
        let on = if round % 2 == 1 { &s1 } else { &s0b };
        on.spin(Duration::from_millis(10))?;
        on.copy_peer(&src, &mut dst)?;
        s0.memset(&mut src, later)?;
        let got = s1b.copy_d2h(&dst, &mut host)?.wait()?;
        let bad = got.iter().filter(|&&v| v != want).count();
        ensure(bad == 0, || {
            format!(
                "round {round} (copy on device {}): {bad} of {n} bytes differ; first {:?}, want {want} \
                 (0xEE: the copy landed before the destination's memset; {later}: it read the \
                 source after the later memset; else before the first)",
                on.device().ordinal(),
                got.iter().find(|&&v| v != want)
            )
        })?;
    }
    // And the other way, the source on device 1.
    let mut back = DeviceBuffer::<u8>::new(&d0, n)?;
    s1.spin(Duration::from_millis(20))?;
    s1.memset(&mut dst, 0x42)?;
    s0.copy_peer(&dst, &mut back)?;
    s1.memset(&mut dst, 0x43)?;
    let mut host0 = vec![0u8; n];
    let got = s0b.copy_d2h(&back, &mut host0[..])?.wait()?;
    ensure(got.iter().all(|&v| v == 0x42), || {
        format!("device 1 to 0: got {:?}", got.iter().find(|&&v| v != 0x42))
    })
}

/// Typed errors before anything is queued: lengths, a stream on neither device, and (where the
/// pair has no peer access) `NoPeerAccess`; the destination keeps its poison. Zero elements and
/// repeated enabling are fine.
fn peer_errors() -> R {
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    let (s0, s1) = (d0.stream()?, d1.stream()?);
    let n = 4097;
    let (data, _) = random_bytes(n);
    let mut src = DeviceBuffer::<u8>::new(&d0, n)?;
    s0.copy_h2d(&data[..], &mut src)?;
    let mut dst = Guarded::<u8>::new(&s1, GUARD, n + 1, GUARD, 0x5A)?;
    let e = s1.copy_peer(&src, &mut dst.view_mut()?).err();
    ensure(
        matches!(
            e,
            Some(Error::LengthMismatch {
                op: "Stream::copy_peer",
                src: 4097,
                dst: 4098
            })
        ),
        || format!("length mismatch: {e:?}"),
    )?;
    let got = dst.read_checked(&s1, "after a refused copy")?;
    ensure(got.iter().all(|&b| b == 0x5A), || {
        "a refused copy wrote the destination".into()
    })?;
    // Both buffers on device 0, the stream on device 1.
    let mut other = DeviceBuffer::<u8>::new(&d0, n)?;
    let e = s1.copy_peer(&src, &mut other).err();
    ensure(
        matches!(
            e,
            Some(Error::WrongDevice {
                expected: 1,
                found: 0,
                ..
            })
        ),
        || format!("stream on neither device: {e:?}"),
    )?;
    let (a, b) = (d0.can_access_peer(&d1)?, d1.can_access_peer(&d0)?);
    println!("peer access: 0->1 {a}, 1->0 {b}");
    if a {
        // Zero elements: nothing to do, no error.
        let mut empty = DeviceBuffer::<u8>::new(&d1, 0)?;
        s0.copy_peer(&src.slice(..0)?, &mut empty)?;
    }
    ensure(d0.can_access_peer(&d0)?, || {
        "a device reaches itself".into()
    })?;
    let mut fits = Guarded::<u8>::new(&s1, GUARD, n, GUARD, 0x5A)?;
    for (s, ok) in [(&s0, a), (&s1, b)] {
        let r = s.copy_peer(&src, &mut fits.view_mut()?);
        match (ok, r) {
            (true, Ok(())) => {}
            (
                false,
                Err(Error::NoPeerAccess {
                    op: "Stream::copy_peer",
                    ..
                }),
            ) => {}
            (ok, r) => return Err(format!("access {ok}: {r:?}").into()),
        }
    }
    if a && b {
        for _ in 0..3 {
            d0.enable_peer_access(&d1)?;
            d1.enable_peer_access(&d0)?;
        }
        let got = fits.read_checked(&s1, "after the copies")?;
        same("after the copies", &got, &data, 0)?;
    }
    d0.enable_peer_access(&d0)?;
    Ok(())
}

/// Buffers from the stream-ordered pools (`new_async`), which peer access does not cover: the
/// copies still deliver, both ways, and the buffers are freed in stream order after them.
fn peer_stream_ordered_buffers() -> R {
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    let (s0, s1) = (d0.stream()?, d1.stream()?);
    let n = (4 << 20) + 9;
    let (data, seed) = random_bytes(n);
    let mut a = DeviceBuffer::<u8>::new_async(&s0, n)?;
    s0.copy_h2d(&data[..], &mut a)?;
    let mut b = DeviceBuffer::<u8>::new_async(&s1, n)?;
    s1.copy_peer(&a, &mut b)?;
    let mut c = DeviceBuffer::<u8>::new_async(&s0, n)?;
    s0.copy_peer(&b, &mut c)?;
    drop(a);
    drop(b);
    let mut back = vec![0u8; n];
    let got = s0.copy_d2h(&c, &mut back[..])?.wait()?;
    same("0 -> 1 -> 0 through pool memory", got, &data, seed)
}

/// Dropping the source right after a peer copy was queued (behind a slow kernel on the other
/// device) waits for the copy: memory allocated and zeroed at once on the source's device
/// (likely the same address) does not leak into the copy.
fn peer_drop_while_in_flight() -> R {
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    let (s0, s1) = (d0.stream()?, d1.stream()?);
    let n = (16 << 20) + 1;
    let (data, seed) = random_bytes(n);
    let mut dst = DeviceBuffer::<u8>::new(&d1, n)?;
    {
        let mut src = DeviceBuffer::<u8>::new(&d0, n)?;
        s0.copy_h2d(&data[..], &mut src)?;
        s1.spin(Duration::from_millis(100))?;
        s1.copy_peer(&src, &mut dst)?;
    }
    let mut reuse = DeviceBuffer::<u8>::new(&d0, n)?;
    s0.memset(&mut reuse, 0)?;
    let mut back = vec![0u8; n];
    let got = s1.copy_d2h(&dst, &mut back[..])?.wait()?;
    same("copied from a dropped source", got, &data, seed)?;
    // And the destination dropped with the copy in flight.
    let src = DeviceBuffer::<u8>::new(&d0, n)?;
    {
        let mut gone = DeviceBuffer::<u8>::new(&d1, n)?;
        s0.spin(Duration::from_millis(50))?;
        s0.copy_peer(&src, &mut gone)?;
    }
    d0.synchronize()?;
    d1.synchronize()?;
    Ok(())
}

/// `copy_peer` of a pair on one device is a device-to-device copy: guarded, odd sizes, on a
/// stream of that device; different lengths are `LengthMismatch`.
fn peer_same_device() -> R {
    let dev = dev0()?;
    let (s, s2) = (dev.stream()?, dev.stream()?);
    ensure(dev.can_access_peer(&dev)?, || {
        "a device reaches itself".into()
    })?;
    dev.enable_peer_access(&dev)?;
    for size in [1, 4095, (1 << 20) + 13] {
        let (data, seed) = random_bytes(size);
        let mut src = DeviceBuffer::<u8>::new(&dev, size)?;
        s2.copy_h2d(&data[..], &mut src)?;
        let mut dst = Guarded::<u8>::new(&s2, GUARD + 1, size, GUARD + 3, 0x5A)?;
        s.copy_peer(&src, &mut dst.view_mut()?)?;
        let got = dst.read_checked(&s2, "same-device copy_peer")?;
        same(
            &format!("same-device copy_peer of {size} bytes"),
            &got,
            &data,
            seed,
        )?;
        let mut longer = DeviceBuffer::<u8>::new(&dev, size + 1)?;
        let e = s.copy_peer(&src, &mut longer).err();
        ensure(
            matches!(
                e,
                Some(Error::LengthMismatch {
                    op: "Stream::copy_peer",
                    ..
                })
            ),
            || format!("{e:?}"),
        )?;
    }
    Ok(())
}

/// Owned downloads of fresh random data (several types and sizes, views included) kept in a
/// queue, moved to another thread and read there: `wait` (twice), `try_get` once ready,
/// `into_vec`, and an empty download.
fn download_owned_results() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let mut queue: std::collections::VecDeque<(Download<f32>, Vec<u8>, u64)> =
        std::collections::VecDeque::new();
    for n in [1usize, 4097, 1 << 20, (3 << 20) + 5] {
        let (bytes, seed) = random_bytes(n * 4);
        let data: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
        let mut d = DeviceBuffer::<f32>::new(&dev, n)?;
        s.memset(&mut d, 0xEE)?;
        s.copy_h2d(&data[..], &mut d)?;
        queue.push_back((s.download(&d)?, bytes, seed));
        // `d` is dropped here with the download queued: its drop waits for the copy.
    }
    // A view of a u16 buffer, and a download of nothing.
    let (bytes, seed) = random_bytes(2 * 10_000);
    let words: Vec<u16> = bytemuck::pod_collect_to_vec(&bytes);
    let mut d16 = DeviceBuffer::<u16>::new(&dev, words.len())?;
    s.copy_h2d(&words[..], &mut d16)?;
    let part = s.download(&d16.slice(1234..9876)?)?;
    let empty = s.download(&d16.slice(5..5)?)?;
    let reader = std::thread::spawn(move || -> R {
        for (i, (dl, bytes, seed)) in queue.into_iter().enumerate() {
            let what = format!("download {i} of {} f32", bytes.len() / 4);
            ensure(dl.len() * 4 == bytes.len(), || {
                format!("{what}: len {}", dl.len())
            })?;
            same(&what, bytemuck::cast_slice(dl.wait()?), &bytes, seed)?;
            same(&what, bytemuck::cast_slice(dl.wait()?), &bytes, seed)?;
            let polled = dl.try_get()?.ok_or("try_get is None after wait")?;
            same(&what, bytemuck::cast_slice(polled), &bytes, seed)?;
            ensure(dl.is_ready()?, || format!("{what}: not ready after wait"))?;
            let v = dl.into_vec()?;
            same(
                &format!("{what}, into_vec"),
                bytemuck::cast_slice(&v),
                &bytes,
                seed,
            )?;
        }
        same("u16 view", &part.into_vec()?, &words[1234..9876], seed)?;
        ensure(
            empty.is_empty() && empty.is_ready()? && empty.try_get()? == Some(&[][..]),
            || "an empty download".into(),
        )?;
        ensure(empty.into_vec()?.is_empty(), || "empty into_vec".into())
    });
    reader.join().map_err(|_| "the reader thread panicked")?
}

/// Behind a 300 ms kernel, a download into a poisoned buffer is not ready and `try_get` gives
/// nothing; polled (on another thread) until it is, the first data seen is the fresh data, never
/// the poison.
fn download_poll_before_ready() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 8 << 20;
    let (data, seed) = random_bytes(n);
    let poison: Vec<u8> = data.iter().map(|b| !b).collect();
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    s.copy_h2d(&data[..], &mut d)?.wait()?;
    for pooled in [false, true] {
        let pool = PinnedPool::new(&dev, PoolConfig::default())?;
        let what = if pooled {
            "pool block"
        } else {
            "pinned buffer"
        };
        let mut block: PoolBlock<u8> = pool.alloc(n)?;
        block.as_mut_slice()?.copy_from_slice(&poison);
        let pinned = PinnedBuffer::from_slice(&dev, &poison, HostAlloc::DEFAULT)?;
        s.spin(Duration::from_millis(300))?;
        let queued = Instant::now();
        // The first poll, and how long after the kernel was queued it came.
        let early = |ready: bool, got: bool| -> R {
            let at = queued.elapsed();
            if at < Duration::from_millis(250) {
                ensure(!ready && !got, || {
                    format!("{what}: ready ({ready}) or data ({got}) {at:?} into a 300 ms kernel")
                })?;
            }
            Ok(())
        };
        if pooled {
            let dl = s.download_into(&d, block)?;
            early(dl.is_ready()?, dl.try_get()?.is_some())?;
            poll_until_ready(dl, queued, &data, seed, what)?;
        } else {
            let dl = s.download_into(&d, pinned)?;
            early(dl.is_ready()?, dl.try_get()?.is_some())?;
            poll_until_ready(dl, queued, &data, seed, what)?;
        }
    }
    Ok(())
}

/// Moves `dl` (queued behind a 300 ms kernel at `queued`) to another thread that polls it until
/// it is ready, checking that the first data it sees is `want`, and that it was polled unready
/// at least once where the first poll came early enough.
fn poll_until_ready<B>(
    dl: Download<u8, B>,
    queued: Instant,
    want: &[u8],
    seed: u64,
    what: &str,
) -> R
where
    B: pinstream::DownloadTarget<u8> + Send + 'static,
{
    let want = want.to_vec();
    let what = what.to_string();
    let poller = std::thread::spawn(move || -> R {
        let start = Instant::now();
        let early = queued.elapsed() < Duration::from_millis(250);
        let mut unready = 0u32;
        loop {
            match dl.try_get()? {
                None => {
                    unready += 1;
                    ensure(start.elapsed() < Duration::from_secs(20), || {
                        format!("{what}: not ready after 20 s")
                    })?;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Some(got) => {
                    same(&format!("{what}: first data polled"), got, &want, seed)?;
                    break;
                }
            }
        }
        ensure(unready > 0 || !early, || {
            format!("{what}: ready at the first poll, inside the 300 ms kernel")
        })?;
        same(&format!("{what}: wait"), dl.wait()?, &want, seed)
    });
    poller.join().map_err(|_| "the polling thread panicked")?
}

/// Downloads dropped or leaked before their copy ran: a pinned buffer's drop waits, a pool block
/// goes back to the pool and is not handed out under the copy, `mem::forget` is harmless, and
/// nothing is counted as leaked.
fn download_drop_and_forget_unwaited() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 4 << 20;
    let (data, seed) = random_bytes(n);
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    s.copy_h2d(&data[..], &mut d)?.wait()?;
    let leaked = pinstream::memory::leaked();

    // A pinned buffer dropped with its copy behind a kernel.
    s.spin(Duration::from_millis(50))?;
    drop(s.download(&d)?);

    // A pool block dropped unwaited goes back to the pool: what the pool hands out next must not
    // be written by that copy after its new owner has filled it.
    let pool = PinnedPool::new(&dev, PoolConfig::default())?;
    drop(pool.alloc::<u8>(n)?); // one cached block, which the download takes
    s.spin(Duration::from_millis(150))?;
    drop(s.download_into(&d, pool.alloc::<u8>(n)?)?);
    let mut next = pool.alloc::<u8>(n)?;
    let (other, other_seed) = random_bytes(n);
    next.as_mut_slice()?.copy_from_slice(&other);
    s.synchronize()?;
    same(
        "a pool block filled while a dropped download was queued",
        next.as_slice()?,
        &other,
        other_seed,
    )?;
    drop(next);

    // Leaked, both kinds; the stream, the device buffer and the pool work on.
    s.spin(Duration::from_millis(30))?;
    std::mem::forget(s.download(&d)?);
    std::mem::forget(s.download_into(&d, pool.alloc::<u8>(n)?)?);
    let again = s.download_into(&d, pool.alloc::<u8>(n)?)?;
    same("after forgetting two downloads", again.wait()?, &data, seed)?;
    let mut back = vec![0u8; n];
    same(
        "the source after forgotten downloads",
        s.copy_d2h(&d, &mut back[..])?.wait()?,
        &data,
        seed,
    )?;
    let now = pinstream::memory::leaked();
    ensure(now == leaked, || format!("leaked {leaked:?} -> {now:?}"))
}

/// One pinned buffer kept and reused through `into_buffer` for downloads of several lengths:
/// each lands in the buffer's first elements and leaves the rest as it was; `wait_mut` writes
/// in place; a short buffer and a read-only pool block are typed errors.
fn download_into_kept_buffers() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let (mut rng, seed) = rng();
    let cap = 100_000usize;
    let mut mirror: Vec<u32> = (0..cap).map(|_| rng.random::<u32>() | 1).collect();
    let mut buf = PinnedBuffer::from_slice(&dev, &mirror, HostAlloc::DEFAULT)?;
    for n in [cap, 3, 77_777, 0, 1, cap] {
        let data: Vec<u32> = (0..n).map(|_| rng.random::<u32>() | 2).collect();
        let mut d = DeviceBuffer::<u32>::new(&dev, n)?;
        s.copy_h2d(&data[..], &mut d)?;
        s.spin(Duration::from_millis(5))?;
        let mut dl = s.download_into(&d, buf)?;
        ensure(dl.len() == n, || format!("len {} for {n}", dl.len()))?;
        same(&format!("{n} into a kept buffer"), dl.wait()?, &data, seed)?;
        if let Some(first) = dl.wait_mut()?.first_mut() {
            *first = 7;
        }
        buf = dl.into_buffer()?;
        mirror[..n].copy_from_slice(&data);
        if n > 0 {
            mirror[0] = 7;
        }
        ensure(buf.len() == cap, || format!("buffer length {}", buf.len()))?;
        same(
            &format!("the whole buffer after {n}"),
            buf.as_slice()?,
            &mirror,
            seed,
        )?;
    }
    // Too short: refused before anything is queued.
    let d = DeviceBuffer::<u32>::new(&dev, 10)?;
    let short = PinnedBuffer::<u32>::new(&dev, 9, HostAlloc::DEFAULT)?;
    let r = s.download_into(&d, short);
    ensure(
        matches!(
            r,
            Err(Error::LengthMismatch {
                src: 10,
                dst: 9,
                ..
            })
        ),
        || format!("short buffer: {r:?}"),
    )?;
    // A read-only registered pool block is never a destination.
    let ro = PinnedPool::new(
        &dev,
        PoolConfig {
            backing: PoolBacking::Register {
                threads: 2,
                huge_pages: false,
                flags: HostRegister::READ_ONLY,
            },
            ..PoolConfig::default()
        },
    )?;
    let r = s.download_into(&d, ro.alloc::<u32>(10)?);
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("read-only block: {r:?}")
    })?;
    // A block from a pool, longer than the source.
    let (bytes, seed) = random_bytes(4 * 1000);
    let words: Vec<u32> = bytemuck::pod_collect_to_vec(&bytes);
    let mut d = DeviceBuffer::<u32>::new(&dev, 1000)?;
    s.copy_h2d(&words[..], &mut d)?;
    let pool = PinnedPool::new(&dev, PoolConfig::default())?;
    let dl = s.download_into(&d, pool.alloc::<u32>(1500)?)?;
    same("into a longer pool block", dl.wait()?, &words, seed)
}

/// A download waits for a kernel's write on another stream, and a later write waits for the
/// download's read.
fn download_ordered_with_writes() -> R {
    let dev = dev0()?;
    let (a, b) = (dev.stream()?, dev.stream()?);
    let (mut rng, seed) = rng();
    let n = 4 << 20;
    let mut d = DeviceBuffer::<u32>::new(&dev, n)?;
    for round in 0..3 {
        let v = rng.random::<u32>() | 1;
        a.spin(Duration::from_millis(30))?;
        kernels::fill(&a, &mut d, v)?;
        let dl = b.download(&d)?;
        // Written again on `a` before the download has run: that write waits for the read.
        let w = !v;
        kernels::fill(&a, &mut d, w)?;
        let got = dl.wait()?;
        ensure(got.iter().all(|&x| x == v), || {
            let bad = got.iter().position(|&x| x != v).unwrap_or(0);
            format!(
                "round {round}: element {bad} is {:#x}, want {v:#x} (the later write is {w:#x}; seed {seed})",
                got[bad]
            )
        })?;
    }
    Ok(())
}

/// `to_vec` of buffers and both kinds of views returns fresh data written on another stream
/// behind a kernel (ordered after that write), and an empty view gives an empty vector.
fn to_vec_buffers_and_views() -> R {
    let dev = dev0()?;
    let (a, b) = (dev.stream()?, dev.stream()?);
    let n = 300_007;
    let (bytes, seed) = random_bytes(n * 4);
    let data: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
    let src = PinnedBuffer::from_slice(&dev, &data, HostAlloc::DEFAULT)?;
    let mut d = DeviceBuffer::<f32>::new(&dev, n)?;
    b.memset(&mut d, 0xEE)?;
    a.spin(Duration::from_millis(50))?;
    a.copy_h2d(&src, &mut d)?;
    let bits = |v: &[f32]| bytemuck::cast_slice::<f32, u8>(v).to_vec();
    same("DeviceBuffer::to_vec", &bits(&d.to_vec(&b)?), &bytes, seed)?;
    let (lo, hi) = (17, n - 5);
    same(
        "DeviceView::to_vec",
        &bits(&d.slice(lo..hi)?.to_vec(&b)?),
        &bytes[lo * 4..hi * 4],
        seed,
    )?;
    ensure(d.slice(9..9)?.to_vec(&b)?.is_empty(), || {
        "empty view".into()
    })?;
    // A write queued on `a` behind a kernel, read through a writable view on `b`.
    let v = f32::from_bits(rng().0.random::<u32>() | 1);
    a.spin(Duration::from_millis(50))?;
    kernels::fill(&a, &mut d.slice_mut(lo..)?, v)?;
    let got = d.slice_mut(..)?.to_vec(&b)?;
    same(
        "before the filled range",
        &bits(&got[..lo]),
        &bytes[..lo * 4],
        seed,
    )?;
    ensure(got[lo..].iter().all(|x| x.to_bits() == v.to_bits()), || {
        "to_vec read before the fill on another stream".into()
    })?;
    let mut small = DeviceBuffer::<u64>::new(&dev, 3)?;
    kernels::fill(&a, &mut small, 0x0123_4567_89ab_cdef)?;
    ensure(small.to_vec(&b)? == [0x0123_4567_89ab_cdef; 3], || {
        "u64".into()
    })
}
