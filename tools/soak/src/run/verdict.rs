//! The verdict: the producers' ledger against the database, the tap's deliveries, the
//! consumers' applies and the destination's sends (the testkit's checker), recovery after
//! each fault, and the bounds a run must keep; written as JSON and one summary line.

use std::collections::{HashMap, HashSet};

use outbox_testkit::checker::{self, Applied, LedgerRow, Recovery};
use serde_json::json;
use tokio_postgres::Client;

use crate::consumer;
use crate::producer;
use crate::schedule::Fault;
use crate::tap::TAP_PREFETCH;

use super::faults::World;
use super::wiring::queue_depth;
use super::{FaultRecord, RunArgs};

pub(super) struct Timing {
    pub(super) started_ms: i64,
    pub(super) produced_ms: i64,
    pub(super) drain_ms: i64,
    pub(super) drained: bool,
}

fn percentile(sorted: &[i64], p: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    Some(sorted[i])
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn check(
    args: &RunArgs,
    world: &World,
    client: &Client,
    queue: &str,
    mut records: Vec<FaultRecord>,
    produced: producer::Ledger,
    timing: Timing,
    exit_codes: Vec<(String, Option<i32>)>,
    resolved_by_reconciler: usize,
    work: &std::path::Path,
) -> anyhow::Result<bool> {
    let committed_uuids: Vec<uuid::Uuid> = produced.committed.iter().map(|c| c.event_id).collect();
    let committed_set: HashSet<uuid::Uuid> = committed_uuids.iter().copied().collect();

    // The database agrees with the producers: every committed row is there, no rolled-back one.
    let in_db: HashSet<uuid::Uuid> = client
        .query("SELECT event_id FROM outbox_events", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let db_mismatch = in_db.symmetric_difference(&committed_set).count();
    let counts = client
        .query_one(
            "SELECT count(*) FILTER (WHERE parked_at IS NOT NULL),
                    count(*) FILTER (WHERE dispatched_at IS NULL AND parked_at IS NULL)
               FROM outbox_events",
            &[],
        )
        .await?;
    let (parked, pending): (i64, i64) = (counts.get(0), counts.get(1));

    // Deliveries at the broker.
    let deliveries = world.tap.deliveries();
    let delivery = checker::check(&committed_uuids, &deliveries);

    // Rows acked and not marked when their relay was killed: each must have been published
    // again (by whoever took the partition), never only once.
    let mut times_delivered: HashMap<&str, usize> = HashMap::new();
    for d in &deliveries {
        *times_delivered.entry(d.event_id.as_str()).or_default() += 1;
    }
    let ack_not_marked = world.ack_not_marked.lock().unwrap().clone();
    let not_published_again: Vec<String> = ack_not_marked
        .iter()
        .map(|id| id.to_string())
        .filter(|id| times_delivered.get(id.as_str()).copied().unwrap_or(0) < 2)
        .collect();

    // Applies, in the order the consumers applied them.
    let rows = client
        .query(
            "SELECT event_id, aggregate_type, aggregate_id, seq,
                    (extract(epoch FROM applied_at) * 1000)::bigint
               FROM soak_applied ORDER BY n",
            &[],
        )
        .await?;
    let mut applied = Vec::with_capacity(rows.len());
    let mut applied_at: HashMap<String, i64> = HashMap::new();
    for r in &rows {
        let id = r.get::<_, uuid::Uuid>(0).to_string();
        applied_at.entry(id.clone()).or_insert(r.get(4));
        applied.push(Applied {
            event_id: id,
            key: (r.get(1), r.get(2)),
            seq: r.get(3),
        });
    }
    let committed_keys: Vec<(String, (String, String))> = produced
        .committed
        .iter()
        .map(|c| {
            (
                c.event_id.to_string(),
                ("acct".to_owned(), c.aggregate_id.clone()),
            )
        })
        .collect();
    // The group's own records: events it dead-lettered (each with its record in the
    // inbox), gaps it gave up on or jumped over, events of blocked keys it holds.
    let dead: Vec<(String, (String, String), i64)> = client
        .query(
            "SELECT event_id, aggregate_type, aggregate_id, seq FROM outbox_inbox
              WHERE consumer = $1 AND outcome = 'dead'",
            &[&consumer::GROUP],
        )
        .await?
        .iter()
        .map(|r| {
            (
                r.get::<_, uuid::Uuid>(0).to_string(),
                (r.get(1), r.get(2)),
                r.get::<_, Option<i64>>(3).unwrap_or(0),
            )
        })
        .collect();
    let group_counts = client
        .query_one(
            "SELECT (SELECT count(*) FROM outbox_inbox_gaps WHERE consumer = $1),
                    (SELECT count(*) FROM outbox_inbox_held WHERE consumer = $1)",
            &[&consumer::GROUP],
        )
        .await?;
    let (gaps_given_up, held): (i64, i64) = (group_counts.get(0), group_counts.get(1));
    let applied_report = checker::check_applied_or_dead(&committed_keys, &applied, &dead);

    // Effects at the destination against the ledger.
    let expected: Vec<String> = committed_uuids.iter().map(consumer::effect_key).collect();
    let ledger: HashMap<String, LedgerRow> = client
        .query(
            "SELECT effect_key, state, external_id FROM outbox_effects",
            &[],
        )
        .await?
        .iter()
        .map(|r| {
            (
                r.get(0),
                LedgerRow {
                    state: r.get(1),
                    external_id: r.get(2),
                },
            )
        })
        .collect();
    // What the destination holds: an item its worker withdrew (its claim was taken over
    // while it was sending, e.g. SIGSTOPped past the effect lease) was not performed; the
    // report counts those as `destination_deleted`.
    let effects = checker::check_effects(&expected, &world.book.live(), &ledger);

    // Recovery after each fault.
    let commits: Vec<(String, i64)> = produced
        .committed
        .iter()
        .map(|c| (c.event_id.to_string(), c.at_ms))
        .collect();
    let recovery = Recovery::new(&commits, &applied_at);
    for r in &mut records {
        r.recovery_ms = recovery.after(r.ended_ms);
    }
    records.sort_by_key(|r| r.planned.at_ms);
    let mut times: Vec<i64> = records
        .iter()
        .filter(|r| r.injected)
        .filter_map(|r| r.recovery_ms)
        .collect();
    times.sort_unstable();

    let dead_lettered = queue_depth(&world.amqp, &format!("{queue}.dlq"))
        .await
        .map_or(0, |(n, _)| n);
    let injected_copies = *world.injected_copies.lock().unwrap();
    let relays_hit: usize = records
        .iter()
        .filter(|r| r.injected)
        .map(|r| r.planned.fault.relays_hit(args.relays))
        .sum();
    let broker_restarts = records
        .iter()
        .filter(|r| r.injected && matches!(r.planned.fault, Fault::RestartRabbitmq { .. }))
        .count();
    // A fault that hits a relay can make it publish again what it published but had not
    // marked: at most its confirm window (256) plus the acked rows waiting for their mark
    // (one batch, 200); a restart of a service hits every relay. A broker restart may also
    // hand the tap again what it had not acked (its prefetch). Everything else is the
    // copies the soak itself published.
    let duplicate_bound =
        injected_copies + (relays_hit + 1) * (256 + 200) + broker_restarts * TAP_PREFETCH as usize;
    let mut unexpected_exits = Vec::new();
    for slot in world.relays.iter().chain(&world.consumers) {
        unexpected_exits.extend(slot.unexpected_exits().await);
    }

    let mut failures = Vec::new();
    let mut fail = |cond: bool, what: String| {
        if cond {
            failures.push(what);
        }
    };
    fail(
        !timing.drained,
        format!(
            "did not drain within {}",
            humantime::format_duration(args.drain_timeout)
        ),
    );
    fail(delivery.lost > 0, format!("lost {}", delivery.lost));
    fail(
        delivery.unexpected > 0,
        format!("unexpected {}", delivery.unexpected),
    );
    fail(
        delivery.order_violations > 0,
        format!("order violations {}", delivery.order_violations),
    );
    fail(
        !not_published_again.is_empty(),
        format!(
            "{} of {} rows acked but not marked when their relay was killed were not published again (marked without a new ack?): {:?}",
            not_published_again.len(),
            ack_not_marked.len(),
            &not_published_again[..not_published_again.len().min(5)]
        ),
    );
    fail(
        !effects.exactly_once(),
        format!("effects not exactly once: {:?}", effects.examples),
    );
    fail(
        !applied_report.clean(),
        format!(
            "applies out of order or missing: {:?}",
            applied_report.examples
        ),
    );
    fail(
        delivery.duplicates > duplicate_bound,
        format!(
            "duplicates {} above the bound {duplicate_bound}",
            delivery.duplicates
        ),
    );
    fail(parked > 0, format!("parked {parked}"));
    fail(pending > 0, format!("pending {pending}"));
    fail(
        dead_lettered as usize > dead.len(),
        format!(
            "{dead_lettered} messages dead-lettered, {} with a record in the inbox",
            dead.len()
        ),
    );
    fail(
        gaps_given_up > 0,
        format!("the consumer group gave up or jumped {gaps_given_up} gap(s)"),
    );
    fail(
        held > 0,
        format!("the consumer group still holds {held} event(s)"),
    );
    fail(
        db_mismatch > 0,
        format!("database and producers disagree on {db_mismatch} events"),
    );
    fail(
        !unexpected_exits.is_empty(),
        format!("processes exited by themselves: {unexpected_exits:?}"),
    );
    for (name, code) in &exit_codes {
        fail(
            *code != Some(0),
            format!("{name} exited {code:?} after SIGTERM"),
        );
    }
    for r in records.iter().filter(|r| r.note.starts_with("error:")) {
        fail(true, format!("fault '{}' failed: {}", r.what, r.note));
    }
    let pass = failures.is_empty();

    let report = json!({
        "verdict": if pass { "PASS" } else { "FAIL" },
        "failures": failures,
        "seed": args.seed,
        "duration_s": args.duration.as_secs_f64(),
        "produced_s": timing.produced_ms as f64 / 1000.0,
        "drain_s": timing.drain_ms as f64 / 1000.0,
        "started_at_ms": timing.started_ms,
        "load": { "rate": args.rate, "keys": args.keys, "producers": args.producers + 1,
                  "relays": args.relays, "consumers": args.consumers,
                  "lease_s": args.lease.as_secs_f64() },
        "events": {
            "committed": produced.committed.len(),
            "rolled_back": produced.rolled_back.len(),
            "committed_late": produced.late,
            "producer_commits_failed": produced.unknown,
            "producer_transactions_failed": produced.failed,
            "parked": parked,
            "dead_lettered": dead_lettered,
        },
        "groups": [{
            "name": consumer::GROUP,
            "instances": args.consumers,
            "partitions": consumer::PARTITIONS,
            "routed": committed_keys.len(),
            "applied_once": applied_report.applied - applied_report.applied_twice,
            "dead_lettered_with_record": dead.len(),
            "seqs_strictly_increasing_none_skipped": applied_report.not_increasing == 0 && applied_report.gaps == 0,
            "gaps_given_up": gaps_given_up,
            "held_at_the_end": held,
        }],
        "faults": records,
        "faults_injected": records.iter().filter(|r| r.injected).count(),
        "delivery": delivery,
        "between_ack_and_mark": {
            "rows": ack_not_marked.len(),
            "published_again": ack_not_marked.len() - not_published_again.len(),
        },
        "duplicates": {
            "received": delivery.duplicates,
            "injected_copies": injected_copies,
            "bound": duplicate_bound,
        },
        "applied": applied_report,
        "effects": effects,
        "effects_resolved_by_reconciler": resolved_by_reconciler,
        "destination_accepted": world.book.count(),
        "destination_deleted": world.book.deleted(),
        "recovery_ms": {
            "max": times.last(),
            "p50": percentile(&times, 0.5),
            "p90": percentile(&times, 0.9),
        },
        "exit_codes_after_sigterm": exit_codes,
        "unexpected_exits": unexpected_exits,
        "proxies": world.proxies.all().map(|p| json!({"accepted": p.stats().accepted, "broken": p.stats().broken})).collect::<Vec<_>>(),
        "logs": work.display().to_string(),
    });
    let text = serde_json::to_string_pretty(&report)?;
    let path = args
        .report
        .clone()
        .unwrap_or_else(|| work.join("report.json"));
    std::fs::write(&path, &text)?;
    println!("{text}");
    println!("report: {}", path.display());
    println!(
        "group {} ({} instances, {} partitions): {} events routed, {} applied exactly once, {} dead-lettered with a record, applied seqs per key strictly increasing with no event skipped: {}, gaps given up {}",
        consumer::GROUP,
        args.consumers,
        consumer::PARTITIONS,
        committed_keys.len(),
        applied_report.applied - applied_report.applied_twice - applied_report.unexpected,
        dead.len(),
        if applied_report.not_increasing == 0
            && applied_report.gaps == 0
            && applied_report.missing == 0
        {
            "yes"
        } else {
            "NO"
        },
        gaps_given_up,
    );
    let secs =
        |ms: Option<&i64>| ms.map_or("-".to_owned(), |m| format!("{:.1}s", *m as f64 / 1000.0));
    println!(
        "outbox-soak seed={} duration={}: {} | {} events ({} rolled back, {} committed late), {} of {} faults injected, duplicates {} (bound {duplicate_bound}), lost {}, unexpected {}, order violations {}, acked-not-marked rows of killed relays published again {}/{}, effects performed exactly once {}/{}, applied in seq order over {} keys: {}, recovery max {} median {}, drained in {:.1}s{}",
        args.seed,
        humantime::format_duration(args.duration),
        if pass { "PASS" } else { "FAIL" },
        produced.committed.len(),
        produced.rolled_back.len(),
        produced.late,
        records.iter().filter(|r| r.injected).count(),
        records.len(),
        delivery.duplicates,
        delivery.lost,
        delivery.unexpected,
        delivery.order_violations,
        ack_not_marked.len() - not_published_again.len(),
        ack_not_marked.len(),
        effects.expected - effects.missing - effects.performed_twice,
        effects.expected,
        applied_report.keys,
        if applied_report.clean() { "yes" } else { "NO" },
        secs(times.last()),
        secs(percentile(&times, 0.5).as_ref()),
        timing.drain_ms as f64 / 1000.0,
        if pass {
            String::new()
        } else {
            format!(" | failures: {}", failures.join("; "))
        },
    );
    Ok(pass)
}
