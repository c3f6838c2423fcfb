//! Retries and batched writes: [`Retry`] says when an operation that failed may run again,
//! and [`Writer`] is one batched database writer (marks, failures) built on it.
//!
//! Invariants of a writer: at most one batch is in flight; work queued while it runs waits
//! and goes out together in the next batch; a batch that failed goes out again ahead of
//! what was queued after it, and not before its backoff delay has passed; the delay grows
//! with each failure in a row and resets after a success. No IO here: the engine starts the
//! write it is handed and reports back, so the timing is unit-tested with paused time.

use std::time::Duration;

use tokio::time::Instant;

use outbox_kit::internal::Backoff;
use outbox_kit::internal::Down;

/// When an operation that failed may run again (and its down/recovered log lines).
#[derive(Debug)]
pub(crate) struct Retry {
    backoff: Backoff,
    not_before: Option<Instant>,
    down: Down,
}

impl Retry {
    /// Backoff from 100 ms up to 10 s; `what` names the operation in the logs.
    pub(crate) fn new(what: &'static str) -> Retry {
        Retry {
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(10)),
            not_before: None,
            down: Down::new(what),
        }
    }

    /// The operation may run at `now`.
    pub(crate) fn ready(&self, now: Instant) -> bool {
        self.not_before.is_none_or(|t| t <= now)
    }

    /// Until when the operation waits after a failure; `None` when it may run.
    pub(crate) fn not_before(&self) -> Option<Instant> {
        self.not_before
    }

    /// It failed: wait the next backoff delay.
    pub(crate) fn failed(&mut self, e: &dyn std::fmt::Display) {
        let delay = self.backoff.next_delay();
        self.down.failed(e, delay);
        self.not_before = Some(Instant::now() + delay);
    }

    /// It worked: no wait, and the next failure starts from the shortest delay.
    pub(crate) fn ok(&mut self) {
        self.backoff.reset();
        self.not_before = None;
        self.down.recovered();
    }
}

/// One batched writer: work waiting to be written, whether a write is running, and when
/// the next may start after a failure.
#[derive(Debug)]
pub(crate) struct Writer<T> {
    pending: Vec<T>,
    busy: bool,
    retry: Retry,
}

impl<T> Writer<T> {
    /// An idle writer; `what` names the write in the logs.
    pub(crate) fn new(what: &'static str) -> Writer<T> {
        Writer {
            pending: Vec::new(),
            busy: false,
            retry: Retry::new(what),
        }
    }

    /// Queues one item for the next batch.
    pub(crate) fn push(&mut self, item: T) {
        self.pending.push(item);
    }

    /// Items waiting for a batch (not counting the one in flight).
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Nothing waiting and nothing in flight.
    pub(crate) fn is_idle(&self) -> bool {
        !self.busy && self.pending.is_empty()
    }

    /// The next batch, if one is due at `now`: everything waiting. The writer is busy
    /// until [`Writer::succeeded`] or [`Writer::failed`].
    pub(crate) fn start(&mut self, now: Instant) -> Option<Vec<T>> {
        if self.busy || self.pending.is_empty() || !self.retry.ready(now) {
            return None;
        }
        self.busy = true;
        Some(std::mem::take(&mut self.pending))
    }

    /// The batch in flight was written.
    pub(crate) fn succeeded(&mut self) {
        self.busy = false;
        self.retry.ok();
    }

    /// The batch in flight failed: it goes out again, first, after the backoff delay.
    pub(crate) fn failed(&mut self, mut batch: Vec<T>, e: &dyn std::fmt::Display) {
        self.busy = false;
        self.retry.failed(e);
        batch.append(&mut self.pending);
        self.pending = batch;
    }

    /// When a waiting batch becomes due after a failure (`None`: nothing waits on time).
    pub(crate) fn next_due(&self) -> Option<Instant> {
        if self.pending.is_empty() {
            return None;
        }
        self.retry.not_before()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Work queued while a batch is in flight waits for it, then goes out as one batch.
    #[tokio::test(start_paused = true)]
    async fn batches_while_busy() {
        let mut w = Writer::new("test write");
        assert!(w.is_idle());
        assert_eq!(w.start(Instant::now()), None, "nothing to write");
        w.push(1);
        assert_eq!(w.start(Instant::now()), Some(vec![1]));
        assert!(!w.is_idle());
        w.push(2);
        w.push(3);
        assert_eq!(w.start(Instant::now()), None, "one batch at a time");
        assert_eq!(w.pending(), 2);
        w.succeeded();
        assert_eq!(w.start(Instant::now()), Some(vec![2, 3]));
        w.succeeded();
        assert!(w.is_idle());
    }

    /// A failed batch waits its backoff delay, then goes out again ahead of later work;
    /// delays grow with failures in a row and reset after a success.
    #[tokio::test(start_paused = true)]
    async fn retries_after_failure_with_backoff() {
        let mut w = Writer::new("test write");
        w.push(1);
        let batch = w.start(Instant::now()).expect("due");
        w.push(2);
        w.failed(batch, &"connection refused");
        let due = w.next_due().expect("waits after a failure");
        let first_delay = due - Instant::now();
        assert!(first_delay >= Duration::from_millis(100), "{first_delay:?}");
        assert!(first_delay <= Duration::from_secs(10), "{first_delay:?}");
        assert_eq!(w.start(Instant::now()), None, "not before the backoff");

        tokio::time::advance(first_delay - Duration::from_millis(1)).await;
        assert_eq!(w.start(Instant::now()), None, "still waiting");
        tokio::time::advance(Duration::from_millis(1)).await;
        let batch = w.start(Instant::now()).expect("due after the backoff");
        assert_eq!(batch, vec![1, 2], "the failed batch first");

        // A second failure in a row waits at least as long as the first's minimum.
        w.failed(batch, &"connection refused");
        let second_delay = w.next_due().expect("waits") - Instant::now();
        assert!(
            second_delay >= Duration::from_millis(200),
            "{second_delay:?}"
        );
        tokio::time::advance(second_delay).await;
        let batch = w.start(Instant::now()).expect("due");
        w.succeeded();
        assert_eq!(batch, vec![1, 2]);
        assert_eq!(w.next_due(), None);

        // After a success the next write goes out at once.
        w.push(3);
        assert_eq!(w.start(Instant::now()), Some(vec![3]));
    }
}
