//! Host allocation and registration flags: a CPU trial, run everywhere; `HostRegistration`
//! (memory owned elsewhere, page-locked until dropped): GPU trials, ignored without a device.

use crate::common::{ensure, random_bytes, same, R};
use libtest_mimic::Trial;
use pinstream::{Device, DeviceBuffer, Error, HostAlloc, HostRegister, HostRegistration};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "host/";

/// The trials of this module, named `host/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    vec![
        trial(PREFIX, "memory/flags", memory_flags),
        trial(
            PREFIX,
            "registration/roundtrip_and_unregisters",
            registration_roundtrip,
        )
        .with_ignored_flag(no_gpu),
    ]
}

/// Registered memory copies to the device and back intact; registering it again while it is
/// registered fails (so it was registered), and succeeds after the drop (so it was
/// unregistered).
fn registration_roundtrip() -> R {
    let device = Device::get(0)?;
    let stream = device.stream()?;
    let n = (1 << 20) + 13;
    let (mut host, seed) = random_bytes(n);
    let ptr = host.as_mut_ptr();
    // An empty or null range is refused before the runtime is asked.
    // SAFETY: nothing is registered (refused); the memory stays alive meanwhile.
    let r = unsafe { HostRegistration::new(&device, ptr, 0, HostRegister::DEFAULT) };
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("{r:?}")
    })?;
    // SAFETY: as above.
    let r =
        unsafe { HostRegistration::new(&device, std::ptr::null_mut(), n, HostRegister::DEFAULT) };
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("{r:?}")
    })?;
    // SAFETY: `host` stays allocated and unmoved until the registration is dropped below, and
    // every copy from it is waited for before that.
    let reg = unsafe { HostRegistration::new(&device, ptr, n, HostRegister::PORTABLE)? };
    ensure(reg.len() == n && !reg.is_empty(), || {
        format!("len {}", reg.len())
    })?;
    // SAFETY: as above; this second registration of the same range must fail.
    let again = unsafe { HostRegistration::new(&device, ptr, n, HostRegister::DEFAULT) };
    ensure(matches!(again, Err(Error::Cuda { .. })), || {
        format!("{again:?}")
    })?;
    let mut dev = DeviceBuffer::<u8>::new(&device, n)?;
    stream.copy_h2d(&host, &mut dev)?.wait()?;
    let mut back = vec![0xA5u8; n];
    stream.copy_d2h(&dev, &mut back)?.wait()?;
    same("registered round trip", &back, &host, seed)?;
    drop(reg);
    // SAFETY: as above; registered and dropped at once.
    let third = unsafe { HostRegistration::new(&device, ptr, n, HostRegister::DEFAULT)? };
    drop(third);
    drop(host);
    Ok(())
}

fn memory_flags() -> R {
    let f = HostAlloc::PORTABLE | HostAlloc::MAPPED;
    ensure(
        f.contains(HostAlloc::PORTABLE) && f.contains(HostAlloc::MAPPED),
        || format!("{f:?}"),
    )?;
    ensure(!f.contains(HostAlloc::WRITE_COMBINED), || format!("{f:?}"))?;
    ensure(
        HostAlloc::default() == HostAlloc::DEFAULT && HostAlloc::DEFAULT.bits() == 0,
        || "default".into(),
    )?;
    let r = HostRegister::READ_ONLY | HostRegister::PORTABLE;
    ensure(
        r.contains(HostRegister::READ_ONLY) && !r.contains(HostRegister::MAPPED),
        || format!("{r:?}"),
    )?;
    ensure(HostRegister::default().bits() == 0, || "default".into())
}
