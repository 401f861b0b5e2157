//! Runs a generated sequence on a backend, and compares everything read back with the model.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};

use pinstream::{Error, HostRegister};

use super::plan::{Defect, Gen, Host, Op, Step};
use super::state::{Expect, Model};

/// Something that carries ops out: the GPU through pinstream, or the simulation.
pub trait Backend {
    /// Runs one op (never `ScopeBegin` / `ScopeEnd`) and returns what it read back, if the op
    /// reads anything (see `Model::observe`).
    fn exec(&mut self, op: &Op) -> Result<Option<Vec<u32>>, Error>;

    /// `Registered::scope` over plain vector `plain`: calls `body` with a backend in which
    /// `Host::Reg` / `Host::RegSlice` are that memory. `Err` if registering (then `body` is not
    /// called) or unregistering fails.
    fn scope(
        &mut self,
        plain: usize,
        device: usize,
        flags: HostRegister,
        body: &mut dyn FnMut(&mut dyn Backend),
    ) -> Result<(), Error>;
}

/// What a run did, for the summary line.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub ops: BTreeMap<&'static str, usize>,
    /// Refused calls checked, by defect.
    pub refused: BTreeMap<String, usize>,
    pub read_only_registrations_refused: usize,
    pub reads_compared: usize,
    pub words_compared: usize,
}

impl Stats {
    pub fn merge(&mut self, other: &Stats) {
        for (k, v) in &other.ops {
            *self.ops.entry(k).or_default() += v;
        }
        for (k, v) in &other.refused {
            *self.refused.entry(k.clone()).or_default() += v;
        }
        self.read_only_registrations_refused += other.read_only_registrations_refused;
        self.reads_compared += other.reads_compared;
        self.words_compared += other.words_compared;
    }

    pub fn total_ops(&self) -> usize {
        self.ops.values().sum()
    }

    pub fn summary(&self) -> String {
        let ops: Vec<String> = self.ops.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let refused: Vec<String> = self
            .refused
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        format!(
            "{} ops ({}); refused calls checked: {}; {} reads compared ({} words); {} read-only registrations refused by the platform",
            self.total_ops(),
            ops.join(", "),
            if refused.is_empty() {
                "none".to_string()
            } else {
                refused.join(", ")
            },
            self.reads_compared,
            self.words_compared,
            self.read_only_registrations_refused
        )
    }
}

/// Where a run is, for failure messages.
#[derive(Debug)]
pub struct Ctx<'a> {
    /// The seed of the run (`PINSTREAM_MODEL_SEED` for the GPU trials; the thread's sequence
    /// is drawn from it and the thread index).
    pub seed: u64,
    pub thread: usize,
    /// How to run it again.
    pub repro: String,
    /// Set by the first thread that fails; the others stop.
    pub stop: Option<&'a AtomicBool>,
    pub stats: Stats,
    log: VecDeque<String>,
    next: usize,
}

const LOG: usize = 20;

impl<'a> Ctx<'a> {
    pub fn new(seed: u64, thread: usize, repro: String, stop: Option<&'a AtomicBool>) -> Self {
        Ctx {
            seed,
            thread,
            repro,
            stop,
            stats: Stats::default(),
            log: VecDeque::new(),
            next: 0,
        }
    }

    fn stopped(&self) -> bool {
        self.stop.is_some_and(|s| s.load(Ordering::SeqCst))
    }

    fn note(&mut self, line: String) {
        if self.log.len() == LOG {
            self.log.pop_front();
        }
        self.log.push_back(line);
    }

    fn push(&mut self, step: &Step) -> usize {
        let idx = self.next;
        self.next += 1;
        let defect = step
            .defect
            .map(|d| format!("  [invalid: {d:?}]"))
            .unwrap_or_default();
        self.note(format!("#{idx} {:?}{defect}", step.op));
        idx
    }

    /// The failure message: seed, thread, op index, the op, and the last ops before it.
    pub fn fail(&self, idx: usize, op: &Op, what: impl std::fmt::Display) -> String {
        if let Some(stop) = self.stop {
            stop.store(true, Ordering::SeqCst);
        }
        let log: Vec<&str> = self.log.iter().map(String::as_str).collect();
        format!(
            "seed {}, thread {}, op #{idx}: {what}\n  op: {op:?}\n  last ops, oldest first:\n    {}\n  reproduce: {}",
            self.seed,
            self.thread,
            log.join("\n    "),
            self.repro
        )
    }
}

/// Compares what was read with the model; names the first difference, and says when it is
/// still the poison written before the copy (the data had not arrived yet).
pub fn compare(got: &[u32], want: &[u32], poison: Option<&[u32]>) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "read {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) else {
        return Ok(());
    };
    let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
    let hint = if poison.is_some_and(|p| p.get(i) == Some(&got[i])) {
        " (still the poison written before the copy: the data had not arrived)"
    } else {
        ""
    };
    Err(format!(
        "{bad} of {} elements differ, first at {i}: got {:#010x}, want {:#010x}{hint}",
        want.len(),
        got[i],
        want[i]
    ))
}

/// Runs `gen`'s sequence on `b`, comparing every read with `m`, then reads every buffer back.
pub fn run(b: &mut dyn Backend, gen: &mut Gen, m: &mut Model, ctx: &mut Ctx) -> Result<(), String> {
    seq(b, gen, m, ctx, false)?;
    if ctx.stopped() {
        return Ok(());
    }
    let idx = ctx.next;
    for op in m.final_checks(ctx.seed ^ 0xF1AA_1000) {
        ctx.note(format!("#{idx}.final {op:?}"));
        valid(b, m, ctx, idx, &op)?;
    }
    Ok(())
}

fn seq(
    b: &mut dyn Backend,
    gen: &mut Gen,
    m: &mut Model,
    ctx: &mut Ctx,
    in_scope: bool,
) -> Result<(), String> {
    while !gen.done(m) {
        if ctx.stopped() {
            return Ok(());
        }
        let step = gen.next(m);
        let idx = ctx.push(&step);
        match step.op {
            Op::ScopeEnd if in_scope => return Ok(()),
            Op::ScopeBegin {
                plain,
                device,
                flags,
            } if !in_scope => {
                let mut inner = None;
                let out = b.scope(plain, device, flags, &mut |rb| {
                    m.begin_scope(plain, flags);
                    inner = Some(seq(rb, gen, m, ctx, true));
                });
                *ctx.stats.ops.entry(step.op.name()).or_default() += 1;
                match (inner, out) {
                    (Some(Err(msg)), _) => return Err(msg),
                    (Some(Ok(())), Ok(())) => {
                        m.end_scope();
                        if ctx.stopped() {
                            return Ok(());
                        }
                        // The end of the scope waited for the GPU's last use: the vector holds
                        // everything copied into the registered memory, even by a copy whose
                        // `Pending` was forgotten. (Catches an unregister that does not wait.)
                        let check = Op::HostRead {
                            host: Host::Plain(plain),
                        };
                        ctx.note(format!("#{idx}.after-scope {check:?}"));
                        valid(b, m, ctx, idx, &check)?;
                    }
                    (Some(Ok(())), Err(e)) => {
                        return Err(ctx.fail(
                            idx,
                            &step.op,
                            format!("the scope failed to end: {e}"),
                        ))
                    }
                    // Some platforms cannot register read-only; that must be an error value,
                    // and the sequence goes on without the scope.
                    (None, Err(e)) if flags.contains(HostRegister::READ_ONLY) => {
                        ctx.stats.read_only_registrations_refused += 1;
                        ctx.note(format!("   (read-only registration refused: {e})"));
                    }
                    (None, Err(e)) => {
                        return Err(ctx.fail(idx, &step.op, format!("registration failed: {e}")))
                    }
                    (None, Ok(())) => {
                        return Err(ctx.fail(idx, &step.op, "the scope never ran its body"))
                    }
                }
            }
            Op::ScopeBegin { .. } | Op::ScopeEnd => {
                return Err(ctx.fail(idx, &step.op, "unbalanced scope (generator bug)"))
            }
            ref op => one(b, m, ctx, idx, op, step.defect)?,
        }
    }
    Ok(())
}

fn one(
    b: &mut dyn Backend,
    m: &mut Model,
    ctx: &mut Ctx,
    idx: usize,
    op: &Op,
    defect: Option<Defect>,
) -> Result<(), String> {
    let expect = m.expect(op);
    if expect.map(Expect::defect) != defect {
        let what = format!("generated as {defect:?}, the model expects {expect:?} (test bug)");
        return Err(ctx.fail(idx, op, what));
    }
    *ctx.stats.ops.entry(op.name()).or_default() += 1;
    let Some(ex) = expect else {
        return valid(b, m, ctx, idx, op);
    };
    *ctx.stats
        .refused
        .entry(format!("{:?}", ex.defect()))
        .or_default() += 1;
    // Catches: a missing argument check (the call succeeds, or fails later inside CUDA with
    // another error), or the wrong error variant / numbers.
    match b.exec(op) {
        Ok(_) => return Err(ctx.fail(idx, op, format!("must fail with {ex:?}, but succeeded"))),
        Err(e) if ex.matches(&e) => {}
        Err(e) => {
            return Err(ctx.fail(idx, op, format!("must fail with {ex:?}, failed with {e:?}")))
        }
    }
    // Argument errors are found before anything is queued, so the destination still holds what
    // the model says. Catches a check made after (part of) the work was queued.
    let check = m.check_after_refusal(op, ctx.seed ^ idx as u64);
    ctx.note(format!("#{idx}.check {check:?}"));
    valid(b, m, ctx, idx, &check).map_err(|msg| {
        format!(
            "{msg}\n  (this read follows a refused call: did the refusal change its destination?)"
        )
    })
}

/// Runs a valid op, applies it to the model, and compares what it read back.
fn valid(
    b: &mut dyn Backend,
    m: &mut Model,
    ctx: &mut Ctx,
    idx: usize,
    op: &Op,
) -> Result<(), String> {
    let got = b
        .exec(op)
        .map_err(|e| ctx.fail(idx, op, format!("unexpected error: {e}")))?;
    m.apply(op);
    match (got, m.observe(op)) {
        (None, None) => Ok(()),
        (Some(got), Some(want)) => {
            ctx.stats.reads_compared += 1;
            ctx.stats.words_compared += want.len();
            compare(&got, &want, m.poison_of(op).as_deref())
                .map_err(|msg| ctx.fail(idx, op, format!("wrong data read back: {msg}")))
        }
        (got, want) => {
            let what = format!(
                "the backend read {:?} words, the model expects {:?} (test bug)",
                got.map(|v| v.len()),
                want.map(|v| v.len())
            );
            Err(ctx.fail(idx, op, what))
        }
    }
}
