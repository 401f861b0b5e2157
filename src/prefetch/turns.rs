//! The turn protocol behind [`Source::iter`](super::Source::iter): one iterator shared by many
//! loader threads (of one prefetcher, or of several shards), whose item `i` goes to whoever asks
//! for index `i`, strictly in order.
//!
//! Every way out is explicit, so no caller waits for a turn that will never come:
//!
//! - the iterator ends: every later index ends too ([`Turn::End`]);
//! - the iterator yields an error, or panics: that index gets the error, every later one
//!   [`Turn::Gone`], naming the item that failed (a shard further on learns why its epoch
//!   stopped);
//! - a prefetcher using it stops before the end (dropped, or finished by an error): the
//!   iterator is *abandoned* — nobody will take the dead prefetcher's turns, so everyone waiting
//!   for a later turn is woken with [`Turn::Gone`], and so is any later caller;
//! - an index already taken (a second prefetcher given a clone of a used source): an iterator
//!   serves one pass, so [`Turn::Gone`].
//!
//! The iterator's own code (`next`, `Drop`) runs under `catch_unwind`, and the iterator is
//! dropped as soon as no more items will be taken.

use std::sync::{Condvar, Mutex};

use crate::sync::{drop_quietly, lock, quietly};

/// What [`Turns::take`] gives the caller of index `i`.
#[derive(Debug, PartialEq)]
pub(crate) enum Turn<T, X> {
    /// Item `i`.
    Item(T),
    /// The iterator's error at item `i`, or why it panicked there.
    Failed(FailedItem<X>),
    /// The iterator ended before item `i`.
    End,
    /// Item `i` will never come: the message says why.
    Gone(String),
}

/// An error the iterator yielded, or the message of its panic.
#[derive(Debug, PartialEq)]
pub(crate) enum FailedItem<X> {
    Error(X),
    Panic(String),
}

/// Why no more items will be taken.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Over {
    /// The iterator returned `None` for this index.
    Ended(u64),
    /// Item `.0` was an error or a panic.
    Failed(u64),
    /// A user stopped before the end; the next item would have been `.0`.
    Abandoned(u64),
}

struct State<I> {
    /// `None` once over, and while a caller runs its `next` (`busy`).
    iter: Option<I>,
    busy: bool,
    /// The next index to take.
    next: u64,
    over: Option<Over>,
}

/// An iterator taken in turns.
pub(crate) struct Turns<I> {
    state: Mutex<State<I>>,
    cv: Condvar,
}

impl<I, T, X> Turns<I>
where
    I: Iterator<Item = Result<T, X>>,
{
    pub(crate) fn new(iter: I) -> Self {
        Turns {
            state: Mutex::new(State {
                iter: Some(iter),
                busy: false,
                next: 0,
                over: None,
            }),
            cv: Condvar::new(),
        }
    }

    /// Waits for turn `i` and takes its item. Returns at once for an index already taken, or
    /// once the iterator is over; otherwise when the turns before `i` have been taken, or when
    /// [`abandon`](Self::abandon) is called.
    ///
    /// The iterator's own code (`next`, `Drop`) runs with the lock released: it may stop a
    /// prefetcher of this very source (which abandons the turns) without deadlocking, and a
    /// slow `next` holds up only the turns after it. While it runs, the iterator is out of the
    /// state (`busy`), so nobody else can take it.
    pub(crate) fn take(&self, i: u64) -> Turn<T, X> {
        let mut s = lock(&self.state);
        let mut iter = loop {
            if i < s.next {
                return Turn::Gone(format!(
                    "Source::iter: item {i} was already taken (the iterator is at item {}): an \
                     iterator source serves one pass; make a new Source::iter for another",
                    s.next
                ));
            }
            match s.over {
                Some(Over::Ended(_)) => return Turn::End,
                Some(Over::Failed(k)) => {
                    return Turn::Gone(format!(
                        "Source::iter: the iterator failed at item {k}, so there is no item {i}"
                    ))
                }
                Some(Over::Abandoned(k)) => {
                    return Turn::Gone(format!(
                        "Source::iter: a prefetcher using this iterator stopped before its end \
                         (at item {k}), so item {i} will never come; an iterator source serves \
                         one pass"
                    ))
                }
                None => {}
            }
            if s.next == i && !s.busy {
                if let Some(it) = s.iter.take() {
                    s.busy = true;
                    break it;
                }
            }
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        };
        drop(s);
        let taken = quietly(|| iter.next());
        let mut s = lock(&self.state);
        s.busy = false;
        s.next = i + 1;
        let turn = match taken {
            Ok(Some(Ok(item))) => Turn::Item(item),
            Ok(Some(Err(e))) => {
                s.over.get_or_insert(Over::Failed(i));
                Turn::Failed(FailedItem::Error(e))
            }
            Ok(None) => {
                s.over.get_or_insert(Over::Ended(i));
                Turn::End
            }
            Err(message) => {
                s.over.get_or_insert(Over::Failed(i));
                Turn::Failed(FailedItem::Panic(message))
            }
        };
        // Over (here, or abandoned while `next` ran): the iterator is dropped, outside the lock.
        let done = if s.over.is_some() {
            Some(iter)
        } else {
            s.iter = Some(iter);
            None
        };
        drop(s);
        self.cv.notify_all();
        drop_quietly(done);
        turn
    }

    /// A user stopped before the end: nobody will take its turns, so every waiting and later
    /// caller gets [`Turn::Gone`]. Nothing changes once the iterator is over. The iterator is
    /// dropped here, outside the lock (or, if a `next` is running, by its caller after it).
    pub(crate) fn abandon(&self) {
        let mut s = lock(&self.state);
        let mut done = None;
        if s.over.is_none() {
            s.over = Some(Over::Abandoned(s.next));
            done = s.iter.take();
        }
        drop(s);
        self.cv.notify_all();
        drop_quietly(done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    type R = Result<u64, String>;

    fn counting(n: u64) -> Turns<impl Iterator<Item = R>> {
        Turns::new((0..n).map(Ok))
    }

    #[test]
    fn items_in_turn_then_end() {
        let t = Arc::new(counting(3));
        let waiters: Vec<_> = (0..5u64)
            .rev()
            .map(|i| {
                let t = t.clone();
                std::thread::spawn(move || t.take(i))
            })
            .collect();
        let got: Vec<_> = waiters.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(
            got,
            vec![
                Turn::End,
                Turn::End,
                Turn::Item(2),
                Turn::Item(1),
                Turn::Item(0)
            ]
        );
    }

    #[test]
    fn abandon_wakes_waiters() {
        let t = Arc::new(counting(10));
        assert_eq!(t.take(0), Turn::Item(0));
        let t2 = t.clone();
        // Turn 1 belongs to a user that stops: the waiter for turn 2 must be woken.
        let waiter = std::thread::spawn(move || t2.take(2));
        std::thread::sleep(Duration::from_millis(20));
        t.abandon();
        assert!(matches!(waiter.join().unwrap(), Turn::Gone(m) if m.contains("stopped")));
        assert!(matches!(t.take(1), Turn::Gone(_)));
    }

    #[test]
    fn taken_index_is_gone() {
        let t = counting(10);
        assert_eq!(t.take(0), Turn::Item(0));
        assert_eq!(t.take(1), Turn::Item(1));
        assert!(matches!(t.take(0), Turn::Gone(m) if m.contains("one pass")));
    }

    #[test]
    fn error_then_gone_for_later_turns() {
        let t = Turns::new((0..10u64).map(|i| {
            if i == 2 {
                Err("bad".to_string())
            } else {
                Ok(i)
            }
        }));
        assert_eq!(t.take(0), Turn::Item(0));
        assert_eq!(t.take(1), Turn::Item(1));
        assert_eq!(t.take(2), Turn::Failed(FailedItem::Error("bad".into())));
        assert!(matches!(t.take(3), Turn::Gone(m) if m.contains("failed at item 2")));
    }

    struct Panicky {
        at: u64,
        i: u64,
        dropped: Arc<Mutex<bool>>,
    }
    impl Iterator for Panicky {
        type Item = R;
        fn next(&mut self) -> Option<R> {
            self.i += 1;
            if self.i - 1 == self.at {
                panic!("iterator panics at {}", self.at);
            }
            Some(Ok(self.i - 1))
        }
    }
    impl Drop for Panicky {
        fn drop(&mut self) {
            *self.dropped.lock().unwrap() = true;
            panic!("and its drop panics too");
        }
    }

    #[test]
    fn panic_then_gone_and_dropped() {
        let dropped = Arc::new(Mutex::new(false));
        let t = Arc::new(Turns::new(Panicky {
            at: 1,
            i: 0,
            dropped: dropped.clone(),
        }));
        let t2 = t.clone();
        let later = std::thread::spawn(move || t2.take(3));
        assert_eq!(t.take(0), Turn::Item(0));
        assert!(matches!(
            t.take(1),
            Turn::Failed(FailedItem::Panic(m)) if m.contains("panics at 1")
        ));
        assert!(
            *dropped.lock().unwrap(),
            "the iterator is dropped once over"
        );
        assert!(matches!(t.take(2), Turn::Gone(_)));
        assert!(matches!(later.join().unwrap(), Turn::Gone(_)));
    }
}
