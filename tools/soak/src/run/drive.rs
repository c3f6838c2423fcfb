//! The run itself: start the processes and wait until they hold the partitions and
//! consume, produce while the fault schedule plays, heal, then the quiet period (wait until
//! everything committed is dispatched, seen by the tap, applied once and its effect sent),
//! stop with SIGTERM and hand everything to the verdict.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_kit::consumer::Ledger;
use outbox_kit::consumer::effects::EffectsConfig;
use outbox_kit::consumer::reconcile::{self, ReconcileConfig};
use outbox_kit::contract::Schema;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::consumer;
use crate::destination::Local;
use crate::procs::wait_until;
use crate::producer::{self, Load, now_ms};
use crate::rng::Rng;
use crate::schedule::{Planned, Shape};
use crate::tap;

use super::RunArgs;
use super::faults::{self, World};
use super::verdict::{Timing, check};
use super::wiring::queue_depth;

#[allow(clippy::too_many_arguments)]
pub(super) async fn drive(
    args: &RunArgs,
    shape: &Shape,
    plan: Vec<Planned>,
    world: &Arc<World>,
    client: Client,
    queue: &str,
    work: &std::path::Path,
) -> anyhow::Result<bool> {
    let tap = &world.tap;
    for slot in world.relays.iter().chain(&world.consumers) {
        slot.start().await?;
    }
    let partitions_held = wait_until(Duration::from_secs(60), Duration::from_millis(200), || async {
        client
            .query_one(
                "SELECT count(*) FROM outbox_partitions WHERE owner IS NOT NULL AND lease_until > now()",
                &[],
            )
            .await
            .map(|r| r.get::<_, i64>(0) == 64)
            .unwrap_or(false)
    })
    .await;
    anyhow::ensure!(
        partitions_held,
        "the relays did not take the 64 partitions within 60 s; see {}",
        work.display()
    );
    // Every instance is a live member of the group and every group queue is consumed.
    let group_queues = consumer::group_queues(queue, &world.exchange);
    let consuming = wait_until(
        Duration::from_secs(60),
        Duration::from_millis(300),
        || async {
            let members: i64 = client
                .query_one(
                    "SELECT count(*) FROM outbox_consumer_members WHERE consumer = $1 AND lease_until > now()",
                    &[&consumer::GROUP],
                )
                .await
                .map_or(0, |r| r.get(0));
            if (members as usize) < world.consumers.len() {
                return false;
            }
            for q in &group_queues {
                if queue_depth(&world.amqp, q)
                    .await
                    .is_none_or(|(_, consumers)| consumers == 0)
                {
                    return false;
                }
            }
            true
        },
    )
    .await;
    anyhow::ensure!(
        consuming,
        "the consumer group did not have {} members consuming its {} queues (partitions and intake) within 60 s; see {}",
        world.consumers.len(),
        group_queues.len(),
        work.display()
    );
    println!(
        "relays hold the partitions, {} consumer instances share the group's {} partitions; producing",
        world.consumers.len(),
        group_queues.len() - 1
    );

    // Producers.
    let stop_producing = CancellationToken::new();
    let produced: producer::Shared = Arc::default();
    let rng = Rng::new(args.seed);
    let load = Load {
        rate: args.rate,
        keys: args.keys,
        producers: args.producers,
    };
    let mut producers = Vec::new();
    for id in 0..=args.producers {
        let c = world.target.clone();
        let (r, l, s) = (
            rng.fork(100 + id as u64),
            produced.clone(),
            stop_producing.clone(),
        );
        producers.push(if id == args.producers {
            tokio::spawn(producer::late(id, c, r, load, l, s))
        } else {
            tokio::spawn(producer::steady(id, c, r, load, l, s))
        });
    }

    // The reconciler settles effects a dead consumer left in `sending`.
    let stop_reconciling = CancellationToken::new();
    let reconciled = {
        let target = world.target.clone();
        let cfg = ReconcileConfig::new(
            Duration::from_secs(3),
            Duration::from_secs(3600),
            std::num::NonZeroUsize::new(1000).expect("non-zero"),
            consumer::SEND_TIMEOUT,
        )?;
        let ledger = Ledger::new(EffectsConfig::new(
            "soak-reconciler",
            consumer::SEND_TIMEOUT,
            consumer::WRITE_TIMEOUT,
            consumer::EFFECT_LEASE,
        )?);
        let dest = Local(world.book.clone());
        let stop = stop_reconciling.clone();
        tokio::spawn(async move {
            let mut resolved = 0usize;
            let mut rc: Option<Client> = None;
            while !stop.is_cancelled() {
                if rc.as_ref().is_none_or(|c| c.is_closed()) {
                    rc = target
                        .connect(&Schema::default(), "outbox-soak-reconciler")
                        .await
                        .map_err(|e| eprintln!("soak: reconciler connection: {e}"))
                        .ok();
                }
                if let Some(c) = &rc {
                    match reconcile::reconcile(c, &cfg, &ledger, &dest).await {
                        Ok(r) => resolved += r.resolved.len(),
                        Err(e) => eprintln!("soak: reconcile: {e}"),
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            resolved
        })
    };

    // Processes that exit by themselves are restarted (and reported).
    let stop_monitor = CancellationToken::new();
    let monitor = {
        let (w, stop) = (world.clone(), stop_monitor.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                for slot in w.relays.iter().chain(&w.consumers) {
                    if let Err(e) = slot.check_alive().await {
                        eprintln!("soak: {}: {e}", slot.name);
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        })
    };

    // The fault schedule.
    let t0 = tokio::time::Instant::now();
    let started_ms = now_ms();
    let (records, faults) = faults::play(plan, world, t0, started_ms);
    if args.plant_unexpected {
        tokio::time::sleep_until(t0 + Duration::from_secs(2).min(shape.duration)).await;
        let id = tap::publish_stray(&world.amqp, &world.exchange).await?;
        println!("planted a stray event {id} (never committed): the verdict must fail");
    }
    tokio::time::sleep_until(t0 + shape.duration).await;
    for f in faults {
        // Every fault ends before the duration by construction; allow for slow commands.
        let _ = tokio::time::timeout(Duration::from_secs(60), f).await;
    }
    world.heal().await?;
    // A restart of Postgres ended the first connection; this one sees the quiet period.
    let client = if client.is_closed() || client.simple_query("SELECT 1").await.is_err() {
        let fresh = wait_until(
            Duration::from_secs(60),
            Duration::from_millis(500),
            || async {
                world
                    .target
                    .connect(&Schema::default(), "outbox-soak")
                    .await
                    .is_ok()
            },
        )
        .await;
        anyhow::ensure!(
            fresh,
            "no connection to Postgres within 60 s after the faults"
        );
        world
            .target
            .connect(&Schema::default(), "outbox-soak")
            .await?
    } else {
        client
    };
    let client = &client;
    stop_producing.cancel();
    for p in producers {
        let _ = p.await;
    }
    let quiet_started = Instant::now();
    let produced_ms = now_ms() - started_ms;
    println!(
        "faults over, producers stopped after {:.1}s; quiet period: draining",
        produced_ms as f64 / 1000.0
    );

    // The quiet period: wait until everything committed is dispatched, seen by the tap,
    // applied once (or dead-lettered with a record), and its effect is sent.
    let committed_ids: HashSet<String> = produced
        .lock()
        .unwrap()
        .committed
        .iter()
        .map(|c| c.event_id.to_string())
        .collect();
    let drained = wait_until(args.drain_timeout, Duration::from_millis(500), || async {
        let Ok(r) = client
            .query_one(
                "SELECT (SELECT count(*) FROM outbox_events WHERE dispatched_at IS NULL AND parked_at IS NULL),
                        (SELECT count(*) FROM (SELECT event_id FROM soak_applied
                                                UNION SELECT event_id FROM outbox_inbox
                                                       WHERE consumer = $1 AND outcome = 'dead') h),
                        (SELECT count(*) FROM outbox_effects WHERE state <> 'sent')",
                &[&consumer::GROUP],
            )
            .await
        else {
            return false;
        };
        let (pending, applied, open): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
        if pending > 0 || (applied as usize) < committed_ids.len() || open > 0 {
            return false;
        }
        let seen: HashSet<String> = tap.deliveries().into_iter().map(|d| d.event_id).collect();
        committed_ids.iter().all(|id| seen.contains(id))
    })
    .await;
    let drain_ms = quiet_started.elapsed().as_millis() as i64;
    println!(
        "{} in {:.1}s",
        if drained { "drained" } else { "NOT drained" },
        drain_ms as f64 / 1000.0
    );
    stop_monitor.cancel();
    let _ = monitor.await;

    // Stop: SIGTERM, as an orchestrator would; a relay must exit 0.
    let mut exit_codes = Vec::new();
    for slot in world.relays.iter().chain(&world.consumers) {
        let code = match slot.signal("TERM").await {
            Ok(()) => slot.wait_exit(Duration::from_secs(30)).await.ok().flatten(),
            Err(_) => None,
        };
        exit_codes.push((slot.name.clone(), code));
    }
    stop_reconciling.cancel();
    let resolved_by_reconciler = reconciled.await.unwrap_or(0);
    // Let the last deliveries reach the tap: until its count holds still for a second.
    let mut last = tap.count();
    let _ = wait_until(Duration::from_secs(10), Duration::from_secs(1), || {
        let now = tap.count();
        let still = now == last;
        last = now;
        async move { still }
    })
    .await;

    let records = records.lock().unwrap().clone();
    let produced = std::mem::take(&mut *produced.lock().unwrap());
    let verdict = check(
        args,
        world,
        client,
        queue,
        records,
        produced,
        Timing {
            started_ms,
            produced_ms,
            drain_ms,
            drained,
        },
        exit_codes,
        resolved_by_reconciler,
        work,
    )
    .await?;
    Ok(verdict)
}
