//! Wake-up pacing: whether the relay is busy (rows keep coming faster than a NOTIFY per
//! transaction is worth: claims run back to back and producers send no NOTIFY) or waiting
//! (the next claim is started by a commit's NOTIFY, or by the poll tick), and the
//! producers' wake-up flag that follows from it.
//!
//! Invariants: busy starts when [`BUSY_STREAK`] forward claims in a row each brought
//! [`BUSY_CLAIM_ROWS`] new rows, and ends at the first forward claim that read to the end
//! and found nothing: there is no timer between claims. While busy, every claim is followed
//! by the next (the pass wants one after rows); once a claim comes back empty the relay
//! waits, and the flag goes back on at once, so the next claim is started by a commit. The
//! flag is written one write at a time, only once this relay is registered (its first lease
//! round), and after it was turned on the engine polls once more (a producer may have
//! committed while it was off). The wake-up costs producers
//! nothing while busy (ARCHITECTURE.md, "2. Wake-up"); polling stays the truth: with LISTEN off
//! or down, a waiting relay claims at the poll tick.
//!
//! Why a streak and not a single full claim: every change of the flag is a small write
//! (`outbox_set_wakeup`), and the flag goes back on at the first empty claim. A burst
//! committed in one transaction, or a rate at which claims sometimes bring many rows and
//! sometimes none, would otherwise turn the flag off and on again for nothing. With
//! [`BUSY_CLAIM_ROWS`] rows a claim on average, an empty claim is rare (a lull of a whole
//! claim's round trip), so a steady high rate stays busy.

/// New rows in one forward claim that count towards busy.
pub(crate) const BUSY_CLAIM_ROWS: usize = 8;
/// Forward claims in a row with [`BUSY_CLAIM_ROWS`] new rows each that make the relay busy.
pub(crate) const BUSY_STREAK: usize = 3;

/// Busy or idle, what LISTEN reported, and the wake-up flag (wanted, written, in flight).
#[derive(Debug)]
pub(crate) struct Pacing {
    /// `--listen`: without it the flag is never wanted nor written.
    listen: bool,
    /// Rows keep coming: claims run back to back with the insert wake-up off.
    busy: bool,
    /// Forward claims in a row that brought [`BUSY_CLAIM_ROWS`] new rows or more.
    streak: usize,
    /// LISTEN is connected (as last reported by the listener).
    listen_up: bool,
    /// A NOTIFY arrived since the last claim returned.
    notified: bool,
    /// Rows the last claim returned that no NOTIFY had announced yet. Counted as
    /// unannounced at the next claim unless a NOTIFY comes first: under load a commit's
    /// NOTIFY can reach the relay after a claim that was already running found its rows.
    unheard: usize,
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
            streak: 0,
            listen_up: false,
            notified: false,
            unheard: 0,
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
        if self.flag_heard() && !self.notified {
            self.unheard = new;
        }
        self.notified = false;
        counted
    }

    /// A forward claim returned `new` rows (`reached_end`: it read to the end of the
    /// pending rows). Busy polling has no timer: while busy the pass claims again after
    /// rows, and after an empty claim the flag goes back on and a commit starts the next.
    pub(crate) fn forward_claimed(&mut self, new: usize, reached_end: bool) {
        self.streak = if new >= BUSY_CLAIM_ROWS {
            self.streak + 1
        } else {
            0
        };
        if self.streak >= BUSY_STREAK {
            self.busy = true; // producers stop sending NOTIFY; claims follow each other
        } else if new == 0 && reached_end {
            // Nothing committed since the last claim's snapshot: wait for a commit.
            self.busy = false;
        }
    }

    /// Every commit from now on sends a NOTIFY that reaches this relay: LISTEN is up, the
    /// relay is not busy, and the flag is on in the database with no write of it in flight.
    /// Then a claim that found rows needs no follow-up claim: the next commit starts one.
    pub(crate) fn commits_announced(&self) -> bool {
        self.listen && !self.busy && !self.wakeup_busy && self.flag_heard()
    }

    /// LISTEN is up and the flag is on in the database: producers' commits send a NOTIFY
    /// that reaches this relay.
    fn flag_heard(&self) -> bool {
        self.listen_up && self.wakeup_db == Some(true)
    }

    /// The flag producers should see: on while waiting for commits (with `--listen`).
    fn wakeup_wanted(&self) -> bool {
        self.listen && !self.busy
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
            || (self.wakeup_db == Some(self.wakeup_wanted())
                && !(self.renew_due && self.wakeup_wanted()))
        {
            return None;
        }
        self.wakeup_busy = true;
        Some(self.wakeup_wanted())
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

    /// Claims that each bring many rows make the relay busy and turn the flag off; the
    /// first claim after them that reads to the end and finds nothing turns it back on,
    /// with no timer in between (the old design polled every 5 ms for 50 ms first).
    #[test]
    fn busy_until_the_first_empty_claim() {
        let mut p = Pacing::new(true);
        assert_eq!(p.wakeup_due(true, false), Some(true));
        assert!(p.wakeup_written(true), "turned on: poll once more");
        assert_eq!(p.wakeup_due(true, false), None, "written already");

        for _ in 0..BUSY_STREAK {
            assert!(!p.is_busy());
            p.forward_claimed(BUSY_CLAIM_ROWS, false);
        }
        assert!(p.is_busy());
        assert_eq!(p.wakeup_due(true, false), Some(false), "busy: flag off");
        assert!(!p.wakeup_written(false));

        // Fewer rows, or a claim that stopped at its limit with none new: still busy.
        p.forward_claimed(1, true);
        p.forward_claimed(0, false);
        assert!(p.is_busy());
        assert_eq!(p.wakeup_due(true, false), None);

        // Read to the end and found nothing: waiting for a commit, flag on at once.
        p.forward_claimed(0, true);
        assert!(!p.is_busy());
        assert_eq!(p.wakeup_due(true, false), Some(true), "waiting: flag on");
        assert!(p.wakeup_written(true), "and one more claim closes the race");
    }

    /// One claim with many rows (a burst committed at once), or many rows now and then,
    /// does not turn the flag off: only a streak does.
    #[test]
    fn a_burst_is_not_busy() {
        let mut p = Pacing::new(true);
        p.wakeup_due(true, false);
        p.wakeup_written(true);
        p.forward_claimed(500, true);
        p.forward_claimed(0, true);
        for _ in 0..4 {
            for _ in 1..BUSY_STREAK {
                p.forward_claimed(BUSY_CLAIM_ROWS, true);
            }
            p.forward_claimed(BUSY_CLAIM_ROWS - 1, true);
        }
        assert!(!p.is_busy());
        assert_eq!(p.wakeup_due(true, false), None, "the flag stayed on");

        let mut off = Pacing::new(false);
        for _ in 0..BUSY_STREAK {
            off.forward_claimed(BUSY_CLAIM_ROWS, false);
        }
        off.forward_claimed(0, true);
        assert_eq!(
            off.wakeup_due(true, false),
            None,
            "without --listen no flag"
        );
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

    /// Commits are announced only while LISTEN is up, the relay waits, and the flag is on
    /// with no write of it in flight; busy, or with the flag unknown, they are not.
    #[test]
    fn commits_are_announced_only_with_listen_up_and_the_flag_on() {
        let mut p = Pacing::new(true);
        assert!(!p.commits_announced(), "flag unknown");
        p.listen_up(true);
        assert!(!p.commits_announced(), "flag not written yet");
        assert_eq!(p.wakeup_due(true, false), Some(true));
        assert!(!p.commits_announced(), "flag write in flight");
        p.wakeup_written(true);
        assert!(p.commits_announced());
        p.listen_up(false);
        assert!(!p.commits_announced(), "LISTEN lost");
        p.listen_up(true);
        for _ in 0..BUSY_STREAK {
            p.forward_claimed(BUSY_CLAIM_ROWS, false);
        }
        assert!(!p.commits_announced(), "busy: producers send no NOTIFY");
        assert!(!Pacing::new(false).commits_announced(), "without --listen");
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
