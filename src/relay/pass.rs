//! The claim pass: where the next claim reads (forward from a cursor, a sweep below it, the
//! late-commit look-back, keys asked for by name), whether one is wanted, and when.
//!
//! Claims read forward from a cursor (cheap: only rows not seen yet). Every poll tick,
//! after gaining partitions and after a failed claim, a sweep reads the range below the
//! cursor again from the first pending row, in claims that alternate with forward ones, so
//! a row that committed late with a lower id is found within about one poll interval (no
//! high-water mark on id: polling is the truth, ARCHITECTURE.md "2. Wake-up") and a sweep
//! never sets the forward cursor back.
//!
//! Most late rows are only a little late: a producer's transaction takes its row's id at
//! the INSERT and commits a few milliseconds later, while other producers' rows with higher
//! ids are claimed. At 1,000 events/s from 8 producers that was over 1% of the rows, each
//! waiting for the next sweep (p99 latency 300-500 ms with a 1 s poll interval). So while
//! claims keep up (the last forward claim reached the end), a forward claim reads again
//! the ids that forward claims passed within the last `--late-commit-window`: the rows the
//! relay holds there are left out by the claim itself, so what it finds are the rows that
//! committed after their id was passed.
//!
//! Rows scheduled for later (`available_at`) are not read by cursor: each forward claim
//! reads the ones due, and says when the next one becomes due; the pass claims again then
//! ([`Pass::wake_at`]), so a scheduled row goes out when due, not at the next poll.
//!
//! Invariants: one claim at a time; a wake-up that arrives while a claim runs survives it
//! (that claim's snapshot may predate the commit that woke us).

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::key::Key;
use super::writer::Retry;

/// Forward claims remembered for the look-back (claims run at most every millisecond or so).
const MAX_PASSED: usize = 256;

/// What the next claim reads.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Ids above this one.
    pub(crate) after: i64,
    /// A sweep claim reads only below this id; `None` for a forward claim.
    pub(crate) before: Option<i64>,
    /// A sweep claim (below the cursor), not a forward one.
    pub(crate) sweeping: bool,
    /// Keys asked for by name, wherever their rows are.
    pub(crate) keys: Vec<Key>,
}

/// The claim pass's state.
#[derive(Debug)]
pub(crate) struct Pass {
    cursor: i64,
    /// When each of the last forward claims returned and the cursor it passed from,
    /// oldest first.
    passed: VecDeque<(Instant, i64)>,
    /// The last forward claim reached the end of the pending rows.
    caught_up: bool,
    /// Claim as soon as possible.
    wanted: bool,
    /// A sweep was asked for; it starts when none is running.
    sweep_wanted: bool,
    /// The running sweep: where it is, and where it stops.
    sweep: Option<(i64, i64)>,
    /// The last claim was a sweep claim: the next one reads forward.
    last_was_sweep: bool,
    /// A scheduled row becomes due then: claim (forward) at that time.
    wake_at: Option<Instant>,
    /// Keys whose held rows all went out while more of theirs may be pending: the next
    /// claim asks for them by name, wherever the cursor is.
    continue_keys: HashSet<Key>,
    /// A claim is in flight.
    busy: bool,
    retry: Retry,
}

impl Pass {
    /// At the start: a forward claim and a sweep are wanted.
    pub(crate) fn new() -> Pass {
        Pass {
            cursor: 0,
            passed: VecDeque::new(),
            caught_up: false,
            wanted: true,
            sweep_wanted: true,
            sweep: None,
            last_was_sweep: false,
            wake_at: None,
            continue_keys: HashSet::new(),
            busy: false,
            retry: Retry::new("claim"),
        }
    }

    /// Claim again as soon as possible (a NOTIFY, a connect, rows that went out).
    pub(crate) fn want(&mut self) {
        self.wanted = true;
    }

    /// Claim again, and sweep below the cursor (poll tick, partitions gained).
    pub(crate) fn want_sweep(&mut self) {
        self.wanted = true;
        self.sweep_wanted = true;
    }

    /// More of `key`'s rows may be pending behind the ones that went out: ask for them by
    /// name in the next claim.
    pub(crate) fn continue_key(&mut self, key: Key) {
        self.continue_keys.insert(key);
        self.wanted = true;
    }

    /// A scheduled row becomes due at `at`: claim then (the earliest such time is kept).
    pub(crate) fn wake_at(&mut self, at: Instant) {
        self.wake_at = Some(self.wake_at.map_or(at, |t| t.min(at)));
    }

    /// A claim may start at `now` (if the engine has room and a session).
    pub(crate) fn due(&self, now: Instant) -> bool {
        let woken = self.wake_at.is_some_and(|t| t <= now);
        !self.busy
            && (self.wanted || self.sweep_wanted || self.sweep.is_some() || woken)
            && self.retry.ready(now)
    }

    /// When a wanted claim that waits on time becomes due, or a scheduled row does. A
    /// scheduled time already past is not returned: the engine may be unable to claim
    /// (no session, no room), and a timer that has expired would wake it in a loop; the
    /// claim starts at its next wake-up instead.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        let waiting = if self.wanted {
            self.retry.not_before()
        } else {
            None
        };
        let now = Instant::now();
        let scheduled = self.wake_at.filter(|t| *t > now);
        [waiting, scheduled].into_iter().flatten().min()
    }

    /// Starts a claim of at most `limit` rows at `now` (`window`: the late-commit window):
    /// what it reads. The pass is busy until [`Pass::returned`] or [`Pass::failed`].
    pub(crate) fn start(&mut self, now: Instant, limit: usize, window: Duration) -> Plan {
        self.busy = true;
        if self.wake_at.is_some_and(|t| t <= now) {
            // A scheduled row is due: a forward claim reads it.
            self.wake_at = None;
            self.wanted = true;
        }
        if std::mem::take(&mut self.sweep_wanted) && self.sweep.is_none() {
            self.sweep = Some((0, self.cursor));
        }
        // Sweep and forward claims alternate while a sweep runs. A sweep claim leaves a
        // forward wake-up standing: it only reads below the cursor.
        let sweeping = self.sweep.is_some() && (!self.last_was_sweep || !self.wanted);
        self.last_was_sweep = sweeping;
        if !sweeping {
            self.wanted = false;
        }
        let (after, before) = match self.sweep {
            Some((at, until)) if sweeping => (at, Some(until)),
            _ => (self.forward_from(now, window), None),
        };
        // At most a quarter of the claim goes to keys asked for by name.
        let keys: Vec<Key> = self
            .continue_keys
            .iter()
            .take((limit / 4).max(1))
            .cloned()
            .collect();
        for k in &keys {
            self.continue_keys.remove(k);
        }
        Plan {
            after,
            before,
            sweeping,
            keys,
        }
    }

    /// The claim failed: claim and sweep again after the backoff.
    pub(crate) fn failed(&mut self, e: &dyn std::fmt::Display) {
        self.busy = false;
        self.want_sweep();
        self.retry.failed(e);
    }

    /// The claim returned at `now`: it scanned up to `scanned_to`, reached the end of the
    /// pending rows or not, and added `new` rows to the hand. `announced`: every commit
    /// from now on sends this relay a NOTIFY (LISTEN up, the producers' flag on), so rows
    /// that commit after this claim's snapshot start the next claim themselves.
    pub(crate) fn returned(
        &mut self,
        now: Instant,
        sweeping: bool,
        scanned_to: i64,
        reached_end: bool,
        new: usize,
        announced: bool,
    ) {
        self.busy = false;
        self.retry.ok();
        // `wanted` was cleared when this claim started; a wake-up that came while it ran
        // (its snapshot may predate that commit) has set it again and must survive.
        if sweeping {
            // A sweep reaching its end is done; it never moves the forward cursor.
            self.sweep = if reached_end {
                None
            } else {
                self.sweep.map(|(_, until)| (scanned_to, until))
            };
            self.wanted |= new > 0 || self.sweep.is_some();
            return;
        }
        self.forward_done(now, scanned_to, reached_end);
        // More to read, keys to finish or a sweep to go on with: claim again at once. Rows
        // found by a claim that read to the end say more may be coming; while commits are
        // announced their NOTIFYs start the next claim instead (one claim per wake-up, not
        // two: the follow-up found nothing half the time at 500 events/s).
        let rows_coming = new > 0 && !announced;
        if !reached_end || rows_coming || !self.continue_keys.is_empty() || self.sweep.is_some() {
            self.wanted = true;
        }
    }

    /// A claim is wanted (set again since the last one started, or never cleared).
    #[cfg(test)]
    pub(crate) fn wanted(&self) -> bool {
        self.wanted
    }

    /// Keys that were cut short while a claim ran: ask for them again.
    pub(crate) fn continue_keys(&mut self, keys: impl IntoIterator<Item = Key>) {
        self.continue_keys.extend(keys);
    }

    /// Where the next forward claim starts: the cursor, or while claims keep up, where the
    /// forward claims of the last `window` started.
    fn forward_from(&mut self, now: Instant, window: Duration) -> i64 {
        while self
            .passed
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > window)
        {
            self.passed.pop_front();
        }
        match self.passed.front() {
            Some((_, from)) if self.caught_up => (*from).min(self.cursor),
            _ => self.cursor,
        }
    }

    /// A forward claim returned `scanned_to`; it passed the ids from the cursor up to there.
    fn forward_done(&mut self, now: Instant, scanned_to: i64, reached_end: bool) {
        let from = self.cursor;
        // A claim that stopped early (its limit) goes on from where it stopped, even below
        // the cursor when it started from further back; one that read to the end never
        // moves the cursor back.
        self.cursor = if reached_end {
            self.cursor.max(scanned_to)
        } else {
            scanned_to
        };
        self.caught_up = reached_end;
        if self.passed.len() == MAX_PASSED {
            self.passed.pop_front();
        }
        self.passed.push_back((now, from));
    }
}

#[cfg(test)]
mod tests;
