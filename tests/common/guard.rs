//! Guard bytes around kernel outputs: the output is a view in the middle of a larger device
//! buffer whose regions before and after hold a known non-zero pattern; after the run the whole
//! buffer is read back and every guard element must still hold the pattern (compared as bytes).
//! Inputs are placed at a chosen (possibly odd) offset of a larger buffer too.

use std::fmt::Debug;

use bytemuck::{self, Pod};
use libtest_mimic::Failed;
use pinstream::kernels::{self, DenormInput, DevicePerSample, OutputElement, Spec};
use pinstream::{DeviceBuffer, DeviceView, DeviceViewMut, Stream};

/// Default guard elements on each side.
pub const GUARD: usize = 64;

/// The guard pattern for elements of `T`'s size (1, 2, 4 or 8 bytes): never zero, and for the
/// float types a NaN with a payload that no conversion produces (0x7FA5 is a NaN both as f16 and
/// as bf16, 0x7FC35AA5 as f32), so no correct result can look like an intact guard by chance
/// except for the 1-byte types (0xA5), where guards are checked over many elements.
pub fn guard_value<T: Pod>() -> T {
    let bytes: &[u8] = match std::mem::size_of::<T>() {
        1 => &[0xA5],
        2 => &[0xA5, 0x7F],
        4 => &[0xA5, 0x5A, 0xC3, 0x7F],
        8 => &[0xA5, 0x5A, 0xC3, 0x3C, 0x96, 0x69, 0xF5, 0x7F],
        n => panic!("guard_value: no pattern for {n}-byte elements"),
    };
    bytemuck::pod_read_unaligned(bytes)
}

/// Whether two elements have the same bytes (NaNs included).
pub fn same_bits<T: Pod>(a: &T, b: &T) -> bool {
    bytemuck::bytes_of(a) == bytemuck::bytes_of(b)
}

/// Where operands sit inside their larger buffers, in elements of their own type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Input: bytes before the input view, and after it.
    pub in_offset: usize,
    pub in_tail: usize,
    /// Output: guard elements before and after the output view.
    pub out_before: usize,
    pub out_after: usize,
}

impl Placement {
    /// Aligned for the vectorised kernels (16-byte input offset, output offset a multiple of
    /// 4 elements), with guards of `GUARD` elements.
    pub const ALIGNED: Placement = Placement {
        in_offset: 64,
        in_tail: 16,
        out_before: GUARD,
        out_after: GUARD,
    };
    /// Odd offsets on both sides: only the general kernel may take it.
    pub const ODD: Placement = Placement {
        in_offset: 3,
        in_tail: 5,
        out_before: GUARD + 1,
        out_after: GUARD + 3,
    };
}

/// A device buffer of `before + len + after` elements whose middle `len` elements are the
/// view under test (filled with `poison`), the rest the guard pattern.
pub struct Guarded<T: Pod> {
    buf: DeviceBuffer<T>,
    before: usize,
    len: usize,
}

impl<T: Pod + Debug> Guarded<T> {
    pub fn new(
        stream: &Stream,
        before: usize,
        len: usize,
        after: usize,
        poison: T,
    ) -> pinstream::Result<Self> {
        let mut buf = DeviceBuffer::<T>::new(&stream.device(), before + len + after)?;
        kernels::fill(stream, &mut buf, guard_value::<T>())?;
        if len > 0 {
            kernels::fill(stream, &mut buf.slice_mut(before..before + len)?, poison)?;
        }
        Ok(Guarded { buf, before, len })
    }

    pub fn view(&self) -> pinstream::Result<DeviceView<'_, T>> {
        self.buf.slice(self.before..self.before + self.len)
    }

    pub fn view_mut(&mut self) -> pinstream::Result<DeviceViewMut<'_, T>> {
        self.buf.slice_mut(self.before..self.before + self.len)
    }

    /// Reads the whole buffer back, fails if any guard element changed (naming the first and
    /// counting them), and returns the view's contents.
    pub fn read_checked(&self, stream: &Stream, what: &str) -> Result<Vec<T>, Failed> {
        let mut all = vec![guard_value::<T>(); self.buf.len()];
        stream.copy_d2h(&self.buf, &mut all[..])?.wait()?;
        let g = guard_value::<T>();
        let end = self.before + self.len;
        let bad: Vec<usize> = (0..all.len())
            .filter(|&i| (i < self.before || i >= end) && !same_bits(&all[i], &g))
            .collect();
        if let Some(&first) = bad.first() {
            let side = if first < self.before {
                format!("{} elements before the view", self.before - first)
            } else {
                format!("{} elements after the view's end", first - end)
            };
            return Err(format!(
                "{what}: {} guard elements overwritten; the first {side} holds {:?} (bytes {:02x?}), guard {:?}",
                bad.len(),
                all[first],
                bytemuck::bytes_of(&all[first]),
                g
            )
            .into());
        }
        Ok(all[self.before..end].to_vec())
    }
}

/// `input` at byte `offset` of a device buffer with `tail` more bytes after it; the bytes
/// around it are a non-zero pattern.
pub fn place_input<T: Pod>(
    stream: &Stream,
    input: &[T],
    offset: usize,
    tail: usize,
) -> pinstream::Result<DeviceBuffer<T>> {
    let mut buf = DeviceBuffer::<T>::new(&stream.device(), offset + input.len() + tail)?;
    kernels::fill(stream, &mut buf, guard_value::<T>())?;
    stream.copy_h2d(input, &mut buf.slice_mut(offset..offset + input.len())?)?;
    Ok(buf)
}

/// What a guarded run gives back: the launcher's result (refused or launched) and the output
/// view's contents after the guards were found intact.
pub struct GuardedRun<O> {
    pub result: pinstream::Result<()>,
    pub out: Vec<O>,
}

/// `kernels::normalize::<O>` from `input` (placed as `at` says) into a poisoned output view of
/// `out_len` elements between guards; per-sample statistics from the host if given. Fails if a
/// guard changed, whatever the launcher returned.
#[allow(clippy::too_many_arguments)]
pub fn normalize_guarded<O: OutputElement + Debug>(
    stream: &Stream,
    input: &[u8],
    at: Placement,
    spec: &Spec,
    per: Option<(&[f32], &[f32])>,
    out_len: usize,
    what: &str,
) -> Result<GuardedRun<O>, Failed> {
    let dev = stream.device();
    let d_in = place_input(stream, input, at.in_offset, at.in_tail)?;
    let mut out = Guarded::<O>::new(stream, at.out_before, out_len, at.out_after, O::poison())?;
    let per_dev = match per {
        Some((m, s)) => {
            let mut dm = DeviceBuffer::<f32>::new(&dev, m.len())?;
            let mut ds = DeviceBuffer::<f32>::new(&dev, s.len())?;
            stream.copy_h2d(m, &mut dm)?;
            stream.copy_h2d(s, &mut ds)?;
            Some((dm, ds))
        }
        None => None,
    };
    let p = per_dev
        .as_ref()
        .map(|(m, s)| DevicePerSample { mean: m, std: s });
    let result = kernels::normalize::<O, _, _>(
        stream,
        &d_in.slice(at.in_offset..at.in_offset + input.len())?,
        spec,
        &mut out.view_mut()?,
        p,
    );
    let out = out.read_checked(stream, what)?;
    Ok(GuardedRun { result, out })
}

/// `kernels::denormalize::<I>` from `input` (placed as `at` says, offsets in elements of `I`)
/// into a poisoned u8 output view of `out_len` elements between guards.
pub fn denormalize_guarded<I: DenormInput + Debug>(
    stream: &Stream,
    input: &[I],
    at: Placement,
    spec: &Spec,
    out_len: usize,
    what: &str,
) -> Result<GuardedRun<u8>, Failed> {
    let d_in = place_input(stream, input, at.in_offset, at.in_tail)?;
    let mut out = Guarded::<u8>::new(stream, at.out_before, out_len, at.out_after, 0xAB)?;
    let result = kernels::denormalize::<I, _, _>(
        stream,
        &d_in.slice(at.in_offset..at.in_offset + input.len())?,
        spec,
        &mut out.view_mut()?,
    );
    let out = out.read_checked(stream, what)?;
    Ok(GuardedRun { result, out })
}
