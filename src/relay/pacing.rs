//! Wake-up pacing: whether the relay is busy (rows keep coming, it polls back to back and
//! producers send no NOTIFY) or idle (it waits for a NOTIFY or the poll tick), and the
//! producers' wake-up flag that follows from it.
//!
//! Invariants: busy starts when one claim brings [`BUSY_CLAIM_ROWS`] new rows; while busy,
//! an empty claim is followed by another after [`BUSY_POLL_GAP`], and after [`IDLE_AFTER`]
//! of empty claims the relay is idle again and wants the flag back on. The flag is written
//! one write at a time, only once this relay is registered (its first lease round), and
//! after it was turned on the engine polls once more (a producer may have committed while
//! it was off). The wake-up costs producers nothing while busy (ARCHITECTURE.md, "2. Wake-up").

use std::time::Duration;

use tokio::time::Instant;

/// New rows in one claim that mark the relay as busy: rows arrive faster than a NOTIFY per
/// transaction is worth; it turns the insert wake-up off and polls back to back.
pub(crate) const BUSY_CLAIM_ROWS: usize = 8;
/// Busy and a poll came back empty: the next one after this gap.
pub(crate) const BUSY_POLL_GAP: Duration = Duration::from_millis(5);
/// Busy polls empty for this long: idle again (the wake-up goes back on).
pub(crate) const IDLE_AFTER: Duration = Duration::from_millis(50);

/// Busy or idle, what LISTEN reported, and the wake-up flag (wanted, written, in flight).
#[derive(Debug)]
pub(crate) struct Pacing {
    /// `--listen`: without it the flag is never wanted nor written.
    listen: bool,
    /// Rows keep coming: the relay polls back to back with the insert wake-up off.
    busy: bool,
    /// Busy, and claims have come back empty since then.
    empty_since: Option<Instant>,
    /// LISTEN is connected (as last reported by the listener).
    listen_up: bool,
    /// A NOTIFY arrived since the last claim returned.
    notified: bool,
    /// Rows the last claim returned that no NOTIFY had announced yet. Counted as
    /// unannounced at the next claim unless a NOTIFY comes first: under load a commit's
    /// NOTIFY can reach the relay after a claim that was already running found its rows.
    unheard: usize,
    /// The flag producers should see.
    wakeup_wanted: bool,
    /// The flag as last written (`None`: unknown).
    wakeup_db: Option<bool>,
    /// The flag is on and a lease round asks for it to be written again. Until then it
    /// stays on in the database, so rows found meanwhile still count as unannounced.
    renew_due: bool,
    /// A flag write is in flight.
    wakeup_busy: bool,
}

impl Pacing {
    /// Idle; with `listen` the flag is wanted on.
    pub(crate) fn new(listen: bool) -> Pacing {
        Pacing {
            listen,
            busy: false,
            empty_since: None,
            listen_up: false,
            notified: false,
            unheard: 0,
            wakeup_wanted: listen,
            wakeup_db: None,
            renew_due: false,
            wakeup_busy: false,
        }
    }

    /// LISTEN connected (again) or was lost.
    pub(crate) fn listen_up(&mut self, up: bool) {
        self.listen_up = up;
    }

    /// A NOTIFY arrived.
    pub(crate) fn notified(&mut self) {
        self.notified = true;
        self.unheard = 0;
    }

    /// A claim returned `new` rows. Returns how many rows no NOTIFY announced although
    /// LISTEN was up and the flag was on (then producers should have sent one): those of the
    /// previous claim for which no NOTIFY came even later.
    pub(crate) fn unannounced(&mut self, new: usize) -> usize {
        let counted = std::mem::take(&mut self.unheard);
        if self.listen_up && self.wakeup_db == Some(true) && !self.notified {
            self.unheard = new;
        }
        self.notified = false;
        counted
    }

    /// A forward claim returned `new` rows (`reached_end`: it read to the end of the
    /// pending rows; `claim_wanted`: another claim is wanted already). Returns when to
    /// claim again while busy polling, if that is what comes next.
    pub(crate) fn forward_claimed(
        &mut self,
        now: Instant,
        new: usize,
        reached_end: bool,
        claim_wanted: bool,
    ) -> Option<Instant> {
        if new >= BUSY_CLAIM_ROWS && !self.busy {
            self.busy = true;
            self.wakeup_wanted = false; // producers stop sending NOTIFY; we poll
        }
        if new > 0 {
            self.empty_since = None;
        } else if reached_end && self.busy {
            // Busy and came back empty: poll again shortly; after a quiet spell, go idle
            // (the hint goes back on, then one more poll closes the race).
            let since = *self.empty_since.get_or_insert(now);
            if now.duration_since(since) >= IDLE_AFTER {
                self.busy = false;
                self.empty_since = None;
                self.wakeup_wanted = self.listen;
            } else {
                return Some(now + BUSY_POLL_GAP);
            }
        } else if reached_end && !claim_wanted {
            self.wakeup_wanted = self.listen;
        }
        None
    }

    /// A lease round succeeded: a flag that is on is written again, so it runs out only
    /// once no live relay renews it.
    pub(crate) fn lease_renewed(&mut self) {
        if self.wakeup_db == Some(true) {
            self.renew_due = true;
        }
    }

    /// The flag to write now, if a write is due (`registered`: this relay has done its
    /// first lease round). The flag is busy until [`Pacing::wakeup_written`] or
    /// [`Pacing::wakeup_failed`].
    pub(crate) fn wakeup_due(&mut self, registered: bool, stopping: bool) -> Option<bool> {
        if !self.listen
            || !registered
            || self.wakeup_busy
            || stopping
            || (self.wakeup_db == Some(self.wakeup_wanted)
                && !(self.renew_due && self.wakeup_wanted))
        {
            return None;
        }
        self.wakeup_busy = true;
        Some(self.wakeup_wanted)
    }

    /// The flag was written as `wanted`. Returns whether to poll once more: it was turned
    /// on (or renewed: had the renewal come late, the flag may have lapsed meanwhile), and a
    /// producer may have committed while it was off.
    pub(crate) fn wakeup_written(&mut self, wanted: bool) -> bool {
        self.wakeup_busy = false;
        self.renew_due = false;
        self.wakeup_db = Some(wanted);
        wanted
    }

    /// The flag write failed; the next pump tries again.
    pub(crate) fn wakeup_failed(&mut self) {
        self.wakeup_busy = false;
    }

    #[cfg(test)]
    fn is_busy(&self) -> bool {
        self.busy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A full claim makes the relay busy and turns the flag off; empty claims then poll
    /// every BUSY_POLL_GAP until IDLE_AFTER has passed, and the flag goes back on.
    #[tokio::test(start_paused = true)]
    async fn busy_then_idle_after_a_quiet_spell() {
        let mut p = Pacing::new(true);
        assert_eq!(p.wakeup_due(true, false), Some(true));
        assert!(p.wakeup_written(true), "turned on: poll once more");
        assert_eq!(p.wakeup_due(true, false), None, "written already");

        let now = Instant::now();
        assert_eq!(p.forward_claimed(now, BUSY_CLAIM_ROWS, false, true), None);
        assert!(p.is_busy());
        assert_eq!(p.wakeup_due(true, false), Some(false), "busy: flag off");
        assert!(!p.wakeup_written(false));

        // Empty and busy: poll again after the gap, until the quiet spell is long enough.
        let now = Instant::now();
        assert_eq!(
            p.forward_claimed(now, 0, true, false),
            Some(now + BUSY_POLL_GAP)
        );
        tokio::time::advance(IDLE_AFTER - ms(1)).await;
        let now = Instant::now();
        assert_eq!(
            p.forward_claimed(now, 0, true, false),
            Some(now + BUSY_POLL_GAP)
        );
        assert!(p.is_busy());
        tokio::time::advance(ms(1)).await;
        assert_eq!(p.forward_claimed(Instant::now(), 0, true, false), None);
        assert!(!p.is_busy(), "idle after IDLE_AFTER");
        assert_eq!(p.wakeup_due(true, false), Some(true), "idle: flag on");
    }

    /// A claim with rows restarts the quiet spell; a few rows do not make an idle relay busy.
    #[tokio::test(start_paused = true)]
    async fn rows_restart_the_quiet_spell() {
        let mut p = Pacing::new(true);
        assert_eq!(
            p.forward_claimed(Instant::now(), BUSY_CLAIM_ROWS - 1, true, false),
            None
        );
        assert!(!p.is_busy());
        p.forward_claimed(Instant::now(), BUSY_CLAIM_ROWS, false, true);
        assert!(p.is_busy());
        assert!(p.forward_claimed(Instant::now(), 0, true, false).is_some());
        tokio::time::advance(ms(40)).await;
        assert_eq!(p.forward_claimed(Instant::now(), 1, true, true), None);
        tokio::time::advance(ms(40)).await;
        // The spell started again at the empty claim after the rows, not 80 ms ago.
        assert!(p.forward_claimed(Instant::now(), 0, true, false).is_some());
        tokio::time::advance(IDLE_AFTER).await;
        assert_eq!(p.forward_claimed(Instant::now(), 0, true, false), None);
        assert!(!p.is_busy());
    }

    /// The flag is written one write at a time, only once registered and not while
    /// stopping; a failed write is tried again; a lease round renews a flag that is on.
    #[test]
    fn the_flag_is_written_once_registered_and_renewed() {
        let mut p = Pacing::new(true);
        assert_eq!(p.wakeup_due(false, false), None, "not registered");
        assert_eq!(p.wakeup_due(true, true), None, "stopping");
        assert_eq!(p.wakeup_due(true, false), Some(true));
        assert_eq!(p.wakeup_due(true, false), None, "one write at a time");
        p.wakeup_failed();
        assert_eq!(p.wakeup_due(true, false), Some(true), "tried again");
        p.wakeup_written(true);
        assert_eq!(p.wakeup_due(true, false), None);
        p.lease_renewed();
        assert_eq!(
            p.wakeup_due(true, false),
            Some(true),
            "renewed each lease round"
        );
        p.wakeup_written(true);
        assert_eq!(p.wakeup_due(true, false), None, "renewed");

        let mut off = Pacing::new(false);
        assert_eq!(off.wakeup_due(true, false), None, "without --listen");
    }

    /// Rows count as unannounced only when LISTEN was up, the flag on, and no NOTIFY came,
    /// not even after the claim that found them (a late NOTIFY still announces them).
    #[test]
    fn unannounced_rows() {
        let mut p = Pacing::new(true);
        assert_eq!(p.unannounced(3), 0, "listen down, flag unknown");
        assert_eq!(p.unannounced(0), 0, "and nothing was kept for later");
        p.listen_up(true);
        p.wakeup_due(true, false);
        p.wakeup_written(true);
        assert_eq!(p.unannounced(3), 0, "counted at the next claim");
        assert_eq!(p.unannounced(0), 3, "no NOTIFY came for them");
        p.notified();
        assert_eq!(p.unannounced(3), 0);
        assert_eq!(p.unannounced(2), 0, "the NOTIFY came before the claim");
        p.notified();
        assert_eq!(p.unannounced(0), 0, "a late NOTIFY announces them still");
        // A lease round asks for the flag to be written again; it is still on meanwhile.
        p.lease_renewed();
        assert_eq!(p.unannounced(4), 0);
        assert_eq!(p.unannounced(0), 4, "counted while the renewal is due");
    }
}
