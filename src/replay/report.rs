//! What a replay reports: the refusal's account of deleted rows ([`Gone`]), the progress line
//! after each batch ([`Progress`]) and the summary at its end ([`Summary`]), each with the
//! text the command prints.

use std::fmt;

/// What deletion has removed of the dispatched rows, as a refusal reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gone {
    /// Dispatched rows deleted in all.
    pub rows: i64,
    /// The highest id deleted.
    pub to_id: i64,
    /// The latest created_at deleted, RFC 3339.
    pub to_created_at: String,
}

impl fmt::Display for Gone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the selection reaches back into events that were deleted (retention): {} dispatched events are gone, up to id {} (created up to {}); replay from --from-id {} or a --since later than {} (under a new --name if this replay had started)",
            self.rows,
            self.to_id,
            self.to_created_at,
            self.to_id + 1,
            self.to_created_at
        )
    }
}

/// A replay's state after a batch, for the progress line.
#[derive(Clone, Debug, PartialEq)]
pub struct Progress {
    pub name: String,
    pub queue: String,
    /// Events confirmed so far, over every run of this replay.
    pub published: i64,
    /// Events selected when the replay started.
    pub total: i64,
    /// Every selected row up to this id was confirmed.
    pub last_id: i64,
    /// Events per second in this run.
    pub per_second: f64,
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "replay {}: {} of {} events re-published to queue {} (up to id {}, {:.0}/s)",
            self.name, self.published, self.total, self.queue, self.last_id, self.per_second
        )
    }
}

/// How a replay ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// `--dry-run`: `total - published` events would be published.
    DryRun,
    /// Every selected event was confirmed.
    Finished,
    /// Finished by an earlier run: nothing done.
    AlreadyFinished,
    /// Stopped by a signal between batches; the same command resumes it.
    Stopped,
}

/// What a replay did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    pub name: String,
    pub queue: String,
    pub ending: Ending,
    /// Events selected when the replay started (for a new dry run: now).
    pub total: i64,
    /// Events confirmed over every run of this replay.
    pub published: i64,
    /// Events confirmed by this run.
    pub published_now: i64,
    /// Every selected row up to this id was confirmed.
    pub last_id: i64,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Summary {
            name,
            queue,
            total,
            published,
            published_now,
            last_id,
            ..
        } = self;
        match self.ending {
            Ending::DryRun if *published == 0 => write!(
                f,
                "replay {name} (dry run): would re-publish {total} events to queue {queue}"
            ),
            Ending::DryRun => write!(
                f,
                "replay {name} (dry run): would re-publish {} events to queue {queue} ({published} of {total} re-published already)",
                total - published
            ),
            Ending::Finished => write!(
                f,
                "replay {name}: finished, {published} events re-published to queue {queue} ({published_now} by this run)"
            ),
            Ending::AlreadyFinished => write!(
                f,
                "replay {name}: finished already ({published} events re-published to queue {queue}); nothing to do, use a new --name to replay again"
            ),
            Ending::Stopped => write!(
                f,
                "replay {name}: stopped after id {last_id}, {published} of {total} events re-published to queue {queue}; run the same command to resume"
            ),
        }
    }
}
