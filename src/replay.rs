//! `outbox-relay replay`: re-publishes retained, dispatched events to one named queue, for
//! a consumer added late or one whose database was restored.
//!
//! A replay has a name. Its selection (aggregate type and id, event type, created_at range,
//! id range) and its progress live in `outbox_replays` (sql/0018): it walks the selected
//! rows by id in batches, publishes each batch through the default exchange with the queue's
//! name as routing key (so no other queue sees it), and records the batch's last id only
//! after every message of the batch was confirmed. Run again under the same name, it resumes
//! after the last recorded id; a batch published but not recorded (a crash, a SIGKILL) is
//! published again, which consumers dedupe by message_id like any redelivery.
//!
//! Invariants: a message is built by the relay's own `prepare` from the row as the relay
//! claims it (`claim::claimed_row`), so message_id, type, headers, seq and body are the ones
//! consumers first saw; only the routing key (the queue) and `x-outbox-replay: true` differ
//! (`publish::mark_replayed`). Confirms are decided by the relay's publish session, so a
//! message counts as delivered only for an ack with no return. A replay never starts, and
//! stops, when its remaining range reaches back into rows that deletion removed
//! (`outbox_retention_horizon`, kept by a trigger on DELETE): the refusal says how much is
//! gone. One process at a time runs a given replay (a session advisory lock).

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::mpsc;
use tokio_postgres::Client;
use tokio_postgres::types::ToSql;
use tokio_util::sync::CancellationToken;

use outbox_kit::amqp::{AmqpError, AmqpTarget};
use outbox_kit::db::DbError;
use outbox_kit::internal::deadline;

use crate::relay::claim::claimed_row;

mod report;
use crate::relay::publish::{
    MessageOptions, Outcome, Session, SessionConfig, mark_replayed, prepare,
};
pub use report::{Ending, Gone, Progress, Summary};

/// Which dispatched events a replay re-publishes. Empty fields do not filter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    /// Created at or after this time.
    pub since: Option<SystemTime>,
    /// Created before this time.
    pub until: Option<SystemTime>,
    /// From this row id on (inclusive).
    pub from_id: Option<i64>,
    /// Up to this row id (inclusive).
    pub to_id: Option<i64>,
}

/// A replay's settings (docs/operating.md, "Replaying events", explains each flag).
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// `--name`: the replay's progress is kept under it; the same name resumes it.
    pub name: String,
    /// `--queue`: the one queue that receives the events.
    pub queue: String,
    pub selection: Selection,
    /// `--rate`: most events published per second.
    pub rate: Option<NonZeroU32>,
    /// `--batch-size`: rows read, published and confirmed before progress is recorded.
    pub batch_size: NonZeroUsize,
    /// `--confirm-timeout`: how long one publish may wait for its confirm.
    pub confirm_timeout: Duration,
    /// `--cloudevents-source`: build messages as a relay run with `--cloudevents` did.
    pub cloudevents_source: Option<String>,
    /// `--dry-run`: count, publish and record nothing.
    pub dry_run: bool,
}

/// Why a replay stopped before its end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// Postgres could not be reached or refused a statement.
    #[error(transparent)]
    Db(#[from] DbError),
    /// The broker could not be reached.
    #[error("cannot connect to rabbitmq: {0}")]
    Amqp(#[from] AmqpError),
    /// The range reaches back into deleted rows.
    #[error("--from-id: {0}")]
    PastRetention(Gone),
    /// The name is taken by another replay, or by one running now.
    #[error("--name: {0}")]
    Name(String),
    /// The broker returned a message as unroutable: the queue does not exist.
    #[error(
        "--queue: no queue named '{0}': the broker returned the replayed event as unroutable; declare the queue first"
    )]
    NoQueue(String),
    /// A message was nacked, timed out or lost with its connection.
    #[error(
        "the broker did not confirm row {row_id}: {why}; the batches confirmed before it are recorded, run the same command again to resume"
    )]
    NotConfirmed { row_id: i64, why: String },
    /// A row cannot be built into a message as it is stored.
    #[error("row {row_id} cannot be published as it is stored: {why}")]
    Unpublishable { row_id: i64, why: String },
}

impl ReplayError {
    /// A problem with the flags given (exit status 2), not a failure.
    pub fn is_bad_flag(&self) -> bool {
        matches!(
            self,
            ReplayError::PastRetention(_) | ReplayError::Name(_) | ReplayError::NoQueue(_)
        )
    }
}

/// The rows a replay selects, `$1 < id <= $2`, with its filters `$3`..`$7`. Walked by the
/// primary key; the filters are checked on the rows read.
macro_rules! selected {
    () => {
        "e.id > $1 AND e.id <= $2 AND e.dispatched_at IS NOT NULL
           AND ($3::text IS NULL OR e.aggregate_type = $3)
           AND ($4::text IS NULL OR e.aggregate_id = $4)
           AND ($5::text IS NULL OR e.event_type = $5)
           AND ($6::timestamptz IS NULL OR e.created_at >= $6)
           AND ($7::timestamptz IS NULL OR e.created_at < $7)"
    };
}

const COUNT: &str = concat!("SELECT count(*) FROM outbox_events e WHERE ", selected!());

/// One batch, `$8` rows, with the columns of `outbox_claim`'s result (by name) so that
/// `claim::claimed_row` reads it: the message is built from what the relay would read.
const BATCH: &str = concat!(
    "SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type,
            coalesce(e.routing_key, e.aggregate_type || '.' || e.event_type) AS routing_key,
            e.payload::text AS body,
            outbox_message_bytes(e.aggregate_type, e.aggregate_id, e.event_type,
                                 coalesce(e.routing_key, e.aggregate_type || '.' || e.event_type),
                                 e.payload::text, e.headers::text, e.traceparent, e.tracestate)
              AS body_bytes,
            e.headers::text AS headers, e.traceparent, e.tracestate,
            extract(epoch FROM e.created_at)::float8 AS created_epoch,
            to_char(e.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
              AS created_text,
            e.attempts, e.seq, 0 AS partition, NULL::bigint AS scanned_to,
            NULL::integer AS scanned, NULL::integer AS per_key, NULL::float8 AS next_due,
            NULL::text AS unreadable
       FROM outbox_events e WHERE ",
    selected!(),
    " ORDER BY e.id LIMIT $8"
);

/// The newest row: a new replay covers the rows up to it (rows dispatched later went to
/// every subscriber anyway).
const NEWEST: &str = "SELECT coalesce(max(id), 0) FROM outbox_events";

/// What deletion removed, if it reaches id `$1` (and, with `$2`, created_at `$2`).
const GONE: &str = "SELECT deleted_rows, deleted_to_id,
       to_char(deleted_to_created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
  FROM outbox_retention_horizon
 WHERE $1::bigint <= deleted_to_id
   AND ($2::timestamptz IS NULL OR $2 <= deleted_to_created_at)";

/// One process runs a replay at a time: held by the command's connection until it ends.
const LOCK: &str = "SELECT pg_try_advisory_lock(hashtextextended('outbox-relay:replay:' || $1, 0))";

const SELECT_REPLAY: &str = "SELECT queue, aggregate_type, aggregate_id, event_type,
       created_from, created_before, from_id, to_id, upper_id, last_id, total, published,
       finished_at IS NOT NULL
  FROM outbox_replays WHERE name = $1";

const INSERT_REPLAY: &str = "INSERT INTO outbox_replays
    (name, queue, aggregate_type, aggregate_id, event_type, created_from, created_before,
     from_id, to_id, upper_id, last_id, total)
  VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
  ON CONFLICT (name) DO NOTHING";

/// Written after a batch's confirms: `$2` the batch's last id, `$3` its size, `$4` the end.
const RECORD: &str = "UPDATE outbox_replays
   SET last_id = $2, published = published + $3, updated_at = now(),
       finished_at = CASE WHEN $4 THEN now() END
 WHERE name = $1";

/// A replay as recorded (or as it would be recorded, for a new dry run).
#[derive(Debug)]
struct State {
    queue: String,
    selection: Selection,
    upper_id: i64,
    last_id: i64,
    total: i64,
    published: i64,
    finished: bool,
}

impl State {
    fn summary(&self, config: &ReplayConfig, ending: Ending, published_now: i64) -> Summary {
        Summary {
            name: config.name.clone(),
            queue: self.queue.clone(),
            ending,
            total: self.total,
            published: self.published,
            published_now,
            last_id: self.last_id,
        }
    }
}

/// Runs a replay (or, with `dry_run`, counts it) until its end, a failure, or `shutdown`
/// (checked between batches: the batch in flight is confirmed and recorded first).
/// `progress` is called after each recorded batch.
pub async fn run(
    client: &Client,
    amqp: &AmqpTarget,
    config: &ReplayConfig,
    shutdown: &CancellationToken,
    mut progress: impl FnMut(&Progress),
) -> Result<Summary, ReplayError> {
    let mut state = match recorded(client, config).await? {
        Some(state) => state,
        None => planned(client, config).await?,
    };
    if state.finished {
        return Ok(state.summary(config, Ending::AlreadyFinished, 0));
    }
    check_retained(client, state.last_id + 1, state.selection.since).await?;
    if config.dry_run {
        return Ok(state.summary(config, Ending::DryRun, 0));
    }
    let locked: bool = deadline(client.query_one(LOCK, &[&config.name]))
        .await?
        .try_get(0)
        .map_err(DbError::from)?;
    if !locked {
        return Err(ReplayError::Name(format!(
            "replay '{}' is running in another process",
            config.name
        )));
    }
    if recorded(client, config).await?.is_none() {
        let s = &state.selection;
        let params: [&(dyn ToSql + Sync); 12] = [
            &config.name,
            &state.queue,
            &s.aggregate_type,
            &s.aggregate_id,
            &s.event_type,
            &s.since,
            &s.until,
            &s.from_id,
            &s.to_id,
            &state.upper_id,
            &state.last_id,
            &state.total,
        ];
        deadline(client.execute(INSERT_REPLAY, &params)).await?;
    }
    let (settled_tx, mut settled_rx) = mpsc::unbounded_channel();
    let session_config = SessionConfig {
        exchange: String::new(),
        declare_exchange: false,
        channels: 1,
        confirm_timeout: config.confirm_timeout,
        connection_name: format!("outbox-relay replay {}", config.name),
    };
    let session = Session::open(amqp, &session_config, 1, settled_tx).await?;
    let result = publish_all(
        client,
        config,
        &mut state,
        &session,
        &mut settled_rx,
        shutdown,
        &mut progress,
    )
    .await;
    session.close().await;
    result
}

/// The batches, one after another: read, check retention, publish, wait for every
/// confirm, record.
async fn publish_all(
    client: &Client,
    config: &ReplayConfig,
    state: &mut State,
    session: &Session,
    settled: &mut mpsc::UnboundedReceiver<crate::relay::publish::SettledBatch>,
    shutdown: &CancellationToken,
    progress: &mut impl FnMut(&Progress),
) -> Result<Summary, ReplayError> {
    let options = MessageOptions {
        cloudevents_source: config.cloudevents_source.clone(),
    };
    // At a low --rate a batch is about a second's worth, so a SIGTERM is seen soon.
    let batch = config
        .rate
        .map_or(config.batch_size.get(), |r| {
            config.batch_size.get().min(r.get() as usize)
        })
        .max(1) as i64;
    let started = Instant::now();
    let mut published_now: i64 = 0;
    let batch_stmt = deadline(client.prepare(BATCH)).await?;
    loop {
        if shutdown.is_cancelled() {
            return Ok(state.summary(config, Ending::Stopped, published_now));
        }
        let s = &state.selection;
        let params: [&(dyn ToSql + Sync); 8] = [
            &state.last_id,
            &state.upper_id,
            &s.aggregate_type,
            &s.aggregate_id,
            &s.event_type,
            &s.since,
            &s.until,
            &batch,
        ];
        let rows = deadline(client.query(&batch_stmt, &params)).await?;
        // Read after the rows: deletion records how far it reached in the same transaction
        // as the delete, so rows it removed before the read above show here.
        check_retained(client, state.last_id + 1, state.selection.since).await?;
        let last = rows.len() < batch as usize;
        let mut ids = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.try_get(0).map_err(DbError::from)?;
            let mut claimed = claimed_row(id, row)?;
            claimed.routing_key = state.queue.clone();
            let message = prepare(&claimed, usize::MAX, &options).map_err(|why| {
                ReplayError::Unpublishable {
                    row_id: id,
                    why: why.to_string(),
                }
            })?;
            if let Some(rate) = config.rate {
                let due = started
                    + Duration::from_secs_f64(
                        (published_now as usize + ids.len()) as f64 / f64::from(rate.get()),
                    );
                tokio::time::sleep_until(due.into()).await;
            }
            session.publish(0, mark_replayed(message));
            ids.push(id);
        }
        confirmed(&state.queue, &ids, session, settled).await?;
        let batch_last_id = if last {
            state.upper_id
        } else {
            *ids.last().unwrap_or(&state.last_id)
        };
        let n = ids.len() as i64;
        deadline(client.execute(RECORD, &[&config.name, &batch_last_id, &n, &last])).await?;
        state.last_id = batch_last_id;
        state.published += n;
        published_now += n;
        progress(&Progress {
            name: config.name.clone(),
            queue: state.queue.clone(),
            published: state.published,
            total: state.total,
            last_id: state.last_id,
            per_second: published_now as f64 / started.elapsed().as_secs_f64().max(0.001),
        });
        if last {
            return Ok(state.summary(config, Ending::Finished, published_now));
        }
    }
}

/// Waits until every row in `ids` was acked without a return, or the first that was not.
async fn confirmed(
    queue: &str,
    ids: &[i64],
    session: &Session,
    settled: &mut mpsc::UnboundedReceiver<crate::relay::publish::SettledBatch>,
) -> Result<(), ReplayError> {
    let mut waiting = ids.len();
    while waiting > 0 {
        let batch = tokio::select! {
            batch = settled.recv() => batch,
            _ = session.lost() => None,
        };
        let Some((_, outcomes)) = batch else {
            return Err(ReplayError::NotConfirmed {
                row_id: ids[ids.len() - waiting],
                why: format!("the broker connection ended: {}", session.lost_why()),
            });
        };
        for s in outcomes {
            let why = match s.outcome {
                Outcome::Acked(_) => {
                    waiting -= 1;
                    continue;
                }
                Outcome::Returned { .. } => return Err(ReplayError::NoQueue(queue.to_owned())),
                Outcome::Nacked => "nacked".to_owned(),
                Outcome::TimedOut => "no confirm within --confirm-timeout".to_owned(),
                Outcome::Lost(why) => why,
            };
            return Err(ReplayError::NotConfirmed {
                row_id: s.row_id,
                why,
            });
        }
    }
    Ok(())
}

/// Refuses when rows from id `first_id` on (created from `since` on) may have been deleted.
async fn check_retained(
    client: &Client,
    first_id: i64,
    since: Option<SystemTime>,
) -> Result<(), ReplayError> {
    let Some(row) = deadline(client.query_opt(GONE, &[&first_id, &since])).await? else {
        return Ok(());
    };
    let gone = (|| {
        Ok::<_, tokio_postgres::Error>(Gone {
            rows: row.try_get(0)?,
            to_id: row.try_get(1)?,
            to_created_at: row.try_get(2)?,
        })
    })()
    .map_err(DbError::from)?;
    Err(ReplayError::PastRetention(gone))
}

/// The replay recorded under the name, checked against the flags given now.
async fn recorded(client: &Client, config: &ReplayConfig) -> Result<Option<State>, ReplayError> {
    let Some(row) = deadline(client.query_opt(SELECT_REPLAY, &[&config.name])).await? else {
        return Ok(None);
    };
    let state = (|| {
        Ok::<_, tokio_postgres::Error>(State {
            queue: row.try_get(0)?,
            selection: Selection {
                aggregate_type: row.try_get(1)?,
                aggregate_id: row.try_get(2)?,
                event_type: row.try_get(3)?,
                since: row.try_get(4)?,
                until: row.try_get(5)?,
                from_id: row.try_get(6)?,
                to_id: row.try_get(7)?,
            },
            upper_id: row.try_get(8)?,
            last_id: row.try_get(9)?,
            total: row.try_get(10)?,
            published: row.try_get(11)?,
            finished: row.try_get(12)?,
        })
    })()
    .map_err(DbError::from)?;
    let given = &config.selection;
    let kept = &state.selection;
    // Times given as durations ("--since 1h") move between runs: the recorded ones stand,
    // as long as the same bounds are given.
    let differs = [
        ("--queue", config.queue != state.queue),
        (
            "--aggregate-type",
            given.aggregate_type != kept.aggregate_type,
        ),
        ("--aggregate-id", given.aggregate_id != kept.aggregate_id),
        ("--event-type", given.event_type != kept.event_type),
        ("--since", given.since.is_some() != kept.since.is_some()),
        ("--until", given.until.is_some() != kept.until.is_some()),
        ("--from-id", given.from_id != kept.from_id),
        ("--to-id", given.to_id != kept.to_id),
    ];
    let differ: Vec<&str> = differs
        .iter()
        .filter(|(_, d)| *d)
        .map(|(flag, _)| *flag)
        .collect();
    if !differ.is_empty() {
        return Err(ReplayError::Name(format!(
            "replay '{}' was started with other {}; run it with the flags it started with to resume, or choose a new --name",
            config.name,
            differ.join(", ")
        )));
    }
    Ok(Some(state))
}

/// A new replay: its range up to the newest row, and how many events it selects.
async fn planned(client: &Client, config: &ReplayConfig) -> Result<State, ReplayError> {
    let s = &config.selection;
    let newest: i64 = deadline(client.query_one(NEWEST, &[]))
        .await?
        .try_get(0)
        .map_err(DbError::from)?;
    let upper_id = s.to_id.map_or(newest, |to| to.min(newest));
    let last_id = s.from_id.map_or(0, |from| from.saturating_sub(1));
    let params: [&(dyn ToSql + Sync); 7] = [
        &last_id,
        &upper_id,
        &s.aggregate_type,
        &s.aggregate_id,
        &s.event_type,
        &s.since,
        &s.until,
    ];
    let total: i64 = deadline(client.query_one(COUNT, &params))
        .await?
        .try_get(0)
        .map_err(DbError::from)?;
    Ok(State {
        queue: config.queue.clone(),
        selection: s.clone(),
        upper_id,
        last_id,
        total,
        published: 0,
        finished: false,
    })
}
