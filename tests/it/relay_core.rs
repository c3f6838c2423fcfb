//! Relay core: the contract end to end, wake-ups, failures and crashes.

use std::time::Duration;

use serde_json::Value;

use crate::support::checker::check;
use crate::support::{Broker, InProcessRelay, TestDb, test_config};

/// 10,000 events from 4 producer connections (plain INSERT and outbox_enqueue) arrive
/// once each with the contract's properties, headers and body; all rows end dispatched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_events_arrive_once_with_the_contract() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));

    let mut producers = Vec::new();
    for p in 0..4 {
        let client = db.client().await;
        producers.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for batch in 0..25 {
                let tx_ids: Vec<uuid::Uuid> = if p % 2 == 0 {
                    let rows = client
                        .query(
                            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers)
                             SELECT 'order', 'p' || $1::int || '-' || (g % 50), 'created',
                                    jsonb_build_object('producer', $1::int, 'n', g), '{\"tenant\": \"acme\"}'
                               FROM generate_series(1, 100) AS g RETURNING event_id",
                            &[&p],
                        )
                        .await
                        .unwrap();
                    rows.iter().map(|r| r.get(0)).collect()
                } else {
                    let mut v = Vec::new();
                    for g in 0..100 {
                        let row = client
                            .query_one(
                                "SELECT outbox_enqueue('invoice', $1, 'issued', jsonb_build_object('b', $2::int, 'g', $3::int))",
                                &[&format!("p{p}-{}", g % 50), &batch, &g],
                            )
                            .await
                            .unwrap();
                        v.push(row.get(0));
                    }
                    v
                };
                ids.extend(tx_ids);
            }
            ids
        }));
    }
    let mut committed = Vec::new();
    for p in producers {
        committed.extend(p.await.unwrap());
    }
    assert_eq!(committed.len(), 10_000);
    broker.wait_count(10_000, Duration::from_secs(120)).await;
    let client = db.client().await;
    crate::support::wait_for("all rows dispatched", Duration::from_secs(30), || async {
        (db.count(&client, "dispatched_at IS NULL").await == 0).then_some(())
    })
    .await;
    relay.stop().await;

    let received = broker.received();
    let report = check(&committed, &received);
    report.assert_clean();
    assert_eq!(report.duplicates, 0, "{report:?}");

    // The contract, checked on one message of each producer kind against its row.
    for m in [&received[0], &received[received.len() - 1]] {
        let row = client
            .query_one(
                "SELECT aggregate_type, aggregate_id, event_type, payload::text, seq,
                        floor(extract(epoch FROM created_at))::bigint,
                        to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
                   FROM outbox_events WHERE event_id = $1::text::uuid",
                &[&m.message_id],
            )
            .await
            .unwrap();
        let (at, aid, et): (String, String, String) = (row.get(0), row.get(1), row.get(2));
        assert_eq!(m.routing_key, format!("{at}.{et}"));
        assert_eq!(m.content_type.as_deref(), Some("application/json"));
        assert_eq!(m.kind.as_deref(), Some(et.as_str()));
        assert_eq!(m.delivery_mode, Some(2));
        assert_eq!(m.timestamp, Some(row.get::<_, i64>(5) as u64));
        assert_eq!(
            m.header_str("x-outbox-aggregate-type").as_deref(),
            Some(at.as_str())
        );
        assert_eq!(
            m.header_str("x-outbox-aggregate-id").as_deref(),
            Some(aid.as_str())
        );
        assert_eq!(m.seq(), Some(row.get::<_, i64>(4)));
        assert_eq!(
            m.header_str("x-outbox-created-at"),
            Some(row.get::<_, String>(6))
        );
        let body: Value = serde_json::from_slice(&m.body).unwrap();
        let payload: Value = serde_json::from_str(&row.get::<_, String>(3)).unwrap();
        assert_eq!(body, payload);
        if at == "order" {
            assert_eq!(m.header_str("tenant").as_deref(), Some("acme"));
        }
    }
    // Per key, seq is 1, 2, 3, ... in publish order.
    let gaps = client
        .query_one(
            "SELECT count(*) FROM (SELECT aggregate_type, aggregate_id, count(*) AS n, max(seq) AS m, count(DISTINCT seq) AS d
               FROM outbox_events GROUP BY 1, 2) k WHERE n <> m OR n <> d",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(gaps, 0, "every key's seq runs 1..n without gaps or repeats");
}

/// Interleaved committed and rolled-back producer transactions: only committed rows arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_rows_are_never_published() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));
    let mut client = db.client().await;
    let (mut committed, mut rolled_back) = (Vec::new(), Vec::new());
    for i in 0..40 {
        let tx = client.transaction().await.unwrap();
        let ids = db.insert_in(&tx, 25, 5, &format!("t{i}")).await;
        if i % 2 == 0 {
            tx.commit().await.unwrap();
            committed.extend(ids);
        } else {
            tx.rollback().await.unwrap();
            rolled_back.extend(ids);
        }
    }
    broker.wait_all(&committed, Duration::from_secs(60)).await;
    // Let a few more polls pass; nothing else may arrive.
    let after = db.client().await;
    crate::support::wait_for("relay idle", Duration::from_secs(10), || async {
        (db.count(&after, "dispatched_at IS NULL").await == 0).then_some(())
    })
    .await;
    relay.stop().await;
    let received = broker.received();
    let report = check(&committed, &received);
    report.assert_clean();
    let rolled: std::collections::HashSet<String> =
        rolled_back.iter().map(|u| u.to_string()).collect();
    assert!(
        received.iter().all(|r| !rolled.contains(&r.message_id)),
        "a rolled-back row was published"
    );
}

/// Rows committed while no relay runs are published when one starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_committed_while_stopped_are_published_on_start() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let client = db.client().await;
    let committed = db.insert(&client, 300, 7).await;
    let relay = InProcessRelay::start(&db, test_config(&broker));
    broker.wait_all(&committed, Duration::from_secs(30)).await;
    relay.stop().await;
    check(&committed, &broker.received()).assert_clean();
}

/// A row whose transaction commits after higher-id rows were published is still published
/// (no high-water mark on id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_commit_with_lower_id_is_published() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let relay = InProcessRelay::start(&db, test_config(&broker));
    let mut slow = db.client().await;
    let fast = db.client().await;
    let slow_tx = slow.transaction().await.unwrap();
    let late = db.insert_in(&slow_tx, 1, 1, "late").await;
    let early = db.insert(&fast, 50, 5).await;
    broker.wait_count(50, Duration::from_secs(30)).await;
    let ids: Vec<i64> = fast
        .query("SELECT id FROM outbox_events ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(ids.len() == 50, "the late row is not visible yet");
    slow_tx.commit().await.unwrap();
    let late_id: i64 = fast
        .query_one(
            "SELECT id FROM outbox_events WHERE event_id = $1",
            &[&late[0]],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        late_id < ids[ids.len() - 1],
        "the late row has a lower id than rows already published"
    );
    broker.wait_count(51, Duration::from_secs(10)).await;
    relay.stop().await;
    let mut all = early;
    all.extend(late);
    check(&all, &broker.received()).assert_clean();
}

/// A row whose transaction commits shortly after claims passed its id (other producers'
/// higher ids committed first) goes out with the next claim, within the late-commit
/// window, not at the next poll's sweep (a minute away here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_committed_just_after_its_id_was_passed_goes_out_with_the_next_claim() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let mut config = test_config(&broker);
    config.poll_interval = Duration::from_secs(60);
    // Wide, so the test does not race the window on a loaded machine.
    config.late_commit_window = Duration::from_secs(5);
    let relay = InProcessRelay::start(&db, config);
    let fast = db.client().await;
    let warm_up = db.insert(&fast, 1, 1).await;
    broker.wait_all(&warm_up, Duration::from_secs(30)).await;
    let mut slow = db.client().await;
    let slow_tx = slow.transaction().await.unwrap();
    let late = db.insert_in(&slow_tx, 1, 1, "late").await;
    let early = db.insert(&fast, 20, 5).await;
    broker.wait_all(&early, Duration::from_secs(30)).await;
    slow_tx.commit().await.unwrap();
    broker.wait_all(&late, Duration::from_secs(3)).await;
    relay.stop().await;
    let mut all = warm_up;
    all.extend(early);
    all.extend(late);
    check(&all, &broker.received()).assert_clean();
}

/// The insert trigger's function (and its NOTIFY) runs only while a live relay wants the
/// wake-up: not with no relay, not once the relay turned it off, not once the relay that
/// asked stopped renewing it. Producers pay for no query otherwise (the WHEN reads a
/// sequence).
#[tokio::test]
async fn the_wakeup_trigger_runs_only_while_a_live_relay_wants_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // Calls of the trigger function by three producer statements in one transaction (of a
    // new session: a session's uncounted calls of earlier transactions show up too).
    async fn calls(db: &TestDb) -> i64 {
        let mut client = db.client().await;
        let tx = client.transaction().await.unwrap();
        tx.batch_execute("SET LOCAL track_functions = 'pl'")
            .await
            .unwrap();
        for _ in 0..3 {
            tx.execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 'k', 'created', '{}')",
                &[],
            )
            .await
            .unwrap();
        }
        let n: Option<i64> = tx
            .query_one(
                "SELECT (SELECT calls FROM pg_stat_xact_user_functions
                          WHERE funcname = 'outbox_wakeup')",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        tx.commit().await.unwrap();
        n.unwrap_or(0)
    }
    assert_eq!(calls(&db).await, 0, "no relay");
    client
        .batch_execute(
            "INSERT INTO outbox_relays (relay_id, host, pid, lease_secs) VALUES ('r', 'h', 1, 15);
             SELECT outbox_set_wakeup('r', true);",
        )
        .await
        .unwrap();
    assert_eq!(calls(&db).await, 3, "an idle relay wants it");
    client
        .batch_execute("SELECT outbox_set_wakeup('r', false)")
        .await
        .unwrap();
    assert_eq!(calls(&db).await, 0, "the relay got busy");
    client
        .batch_execute(
            "UPDATE outbox_relays SET heartbeat_at = now() - interval '46 seconds';
             SELECT outbox_set_wakeup('r', true);",
        )
        .await
        .unwrap();
    assert_eq!(
        calls(&db).await,
        0,
        "its last heartbeat is over three leases old"
    );
}

/// With a 10 s poll interval an event arrives within 200 ms: the NOTIFY path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_the_relay_long_before_the_poll() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let mut config = test_config(&broker);
    config.poll_interval = Duration::from_secs(10);
    let relay = InProcessRelay::start(&db, config);
    let client = db.client().await;
    wait_idle_listening(&db, &client).await;
    // The median of five rounds is the NOTIFY path's latency; every round must be far below
    // the 10 s poll (a loaded 2-core CI machine can stretch one round).
    let mut latencies = Vec::new();
    for round in 0..5 {
        let sent = std::time::Instant::now();
        db.insert(&client, 1, 1).await;
        broker.wait_count(round + 1, Duration::from_secs(5)).await;
        latencies.push(broker.received()[round].at - sent);
    }
    latencies.sort();
    assert!(
        latencies[2] < Duration::from_millis(200),
        "median of {latencies:?}"
    );
    assert!(
        latencies[4] < Duration::from_millis(1500),
        "worst of {latencies:?}"
    );
    // Killing the LISTEN connection loses nothing: the relay reconnects and catches up.
    let killed = db.terminate_relay_connections("outbox-relay-listen").await;
    assert_eq!(killed, 1);
    let more = db.insert(&client, 20, 3).await;
    broker.wait_count(25, Duration::from_secs(15)).await;
    wait_idle_listening(&db, &client).await;
    let sent = std::time::Instant::now();
    db.insert(&client, 1, 1).await;
    broker.wait_count(26, Duration::from_secs(5)).await;
    let latency = broker.received()[25].at.duration_since(sent);
    assert!(
        latency < Duration::from_millis(1500),
        "LISTEN is back (not the 10 s poll): {latency:?}"
    );
    relay.stop().await;
    let received = broker.received();
    assert!(
        more.iter()
            .all(|id| received.iter().any(|r| r.message_id == id.to_string()))
    );
}

/// Claims are started by commits, not by a timer. Producers commit 10 rows every 40 ms:
/// each commit is claimed in one go, and the claim after it finds nothing, so the relay
/// waits with the wake-up on and every commit's NOTIFY starts the next claim. Counted over
/// 40 commits: the producers' NOTIFYs (on a LISTEN connection of the test's own) and the
/// relay's claims by whether they found rows (its own metric). Each commit costs the claim
/// its NOTIFY starts and the one after it, so claims without rows stay within twice those
/// with rows. The old design went busy at one claim of 8 rows, then claimed every 5 ms
/// with the wake-up off until 50 ms passed without rows: at a commit every 40 ms it stayed
/// busy, the commits went unannounced and several empty claims ran between two commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_start_the_claims_not_a_timer() {
    use futures_util::StreamExt;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let mut config = test_config(&broker);
    // No poll tick in the way: only commits, and the flag's renewal each lease round, wake it.
    config.poll_interval = Duration::from_secs(60);
    let tel = outbox_relay::telemetry::Telemetry::default();
    let deps = outbox_relay::relay::Deps {
        pool: db.pool(),
        db: db.target.clone(),
        schema: db.schema.clone(),
        amqp: outbox_kit::amqp::AmqpTarget::parse(&crate::support::amqp_url()).unwrap(),
        telemetry: tel.clone(),
    };
    let relay = InProcessRelay::start_with(deps, config, &crate::support::unique("relay"));
    let claims = |found: &'static str| {
        tel.metrics
            .claims
            .get_or_create(&vec![("found", found)])
            .get()
    };
    // The producers' NOTIFYs, on a connection of the test's own.
    let notified = Arc::new(AtomicUsize::new(0));
    let (listen, mut connection) = db
        .target
        .connect_dedicated(&db.schema, "it-listen")
        .await
        .unwrap();
    let count = notified.clone();
    let listener = tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if matches!(m, tokio_postgres::AsyncMessage::Notification(_)) {
                count.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    tokio::time::timeout(
        Duration::from_secs(20),
        listen.batch_execute(&format!("LISTEN \"{}\"", db.schema.notify_channel())),
    )
    .await
    .expect("LISTEN within 20 s")
    .unwrap();
    let client = db.client().await;
    wait_idle_listening(&db, &client).await;
    // The listener hears the channel (else the count below could not fail for its reason).
    tokio::time::timeout(
        Duration::from_secs(20),
        client.execute(
            "SELECT pg_notify($1, 'test')",
            &[&db.schema.notify_channel()],
        ),
    )
    .await
    .expect("NOTIFY within 20 s")
    .unwrap();
    crate::support::wait_for(
        "the test's own NOTIFY heard",
        Duration::from_secs(10),
        || async { (notified.load(Ordering::Relaxed) > 0).then_some(()) },
    )
    .await;

    const WARMUP: usize = 5;
    const MEASURED: usize = 40;
    let commits = Arc::new(AtomicUsize::new(0));
    let counted = Arc::new(std::sync::Mutex::new(None));
    let producer = {
        let client = db.client().await;
        let (commits, counted) = (commits.clone(), counted.clone());
        let (notified, tel) = (notified.clone(), tel.clone());
        tokio::spawn(async move {
            let claims = |found: &'static str| {
                tel.metrics
                    .claims
                    .get_or_create(&vec![("found", found)])
                    .get()
            };
            let mut ids = Vec::new();
            let mut every = tokio::time::interval(Duration::from_millis(40));
            for n in 0..WARMUP + MEASURED {
                every.tick().await;
                if n == WARMUP {
                    // Counted from here: (NOTIFYs, claims with rows, claims without).
                    *counted.lock().unwrap() = Some((
                        notified.load(Ordering::Relaxed),
                        claims("rows"),
                        claims("none"),
                    ));
                }
                let rows = tokio::time::timeout(
                    Duration::from_secs(20),
                    client.query(
                        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                         SELECT 'order', 'k' || g, 'created', jsonb_build_object('n', $1::int, 'g', g)
                           FROM generate_series(1, 10) AS g
                         RETURNING event_id",
                        &[&(n as i32)],
                    ),
                )
                .await
                .expect("insert within 20 s")
                .unwrap();
                ids.extend(rows.iter().map(|r| r.get::<_, uuid::Uuid>(0)));
                commits.fetch_add(1, Ordering::Relaxed);
            }
            ids
        })
    };
    let committed = tokio::time::timeout(Duration::from_secs(60), producer)
        .await
        .expect("the producer ends within 60 s")
        .unwrap();
    broker
        .wait_count(committed.len(), Duration::from_secs(30))
        .await;
    let (notified_from, rows_from, none_from) = counted.lock().unwrap().expect("counted");
    // Every commit sends its NOTIFY while the relay waits; a few may go unannounced when
    // claims happen to find rows three times in a row (the relay is then busy until the
    // next empty claim). The old design announced next to none.
    crate::support::wait_for_explained(
        "the commits announced by NOTIFY",
        Duration::from_secs(10),
        || async {
            (2 * (notified.load(Ordering::Relaxed) - notified_from) >= MEASURED).then_some(())
        },
        || async {
            format!(
                ": {} NOTIFYs for {MEASURED} commits",
                notified.load(Ordering::Relaxed) - notified_from
            )
        },
    )
    .await;
    let rows = claims("rows") - rows_from;
    let none = claims("none") - none_from;
    let heard = notified.load(Ordering::Relaxed) - notified_from;
    relay.stop().await;
    listener.abort();
    check(&committed, &broker.received()).assert_clean();
    // Each lease round (1 s here) renews the flag and claims once more: a few, not per commit.
    assert!(
        none <= 2 * rows + 6,
        "{none} empty claims for {rows} claims with rows over {MEASURED} commits \
         ({heard} NOTIFYs): claims ran on a timer"
    );
}

/// Waits until the relay holds its partitions, has asked for wake-ups and LISTENs.
async fn wait_idle_listening(db: &TestDb, client: &tokio_postgres::Client) {
    crate::support::wait_for(
        "relay idle with LISTEN",
        Duration::from_secs(20),
        || async {
            let row = client
                .query_one(
                    "SELECT (SELECT bool_and(wants_wakeup) FROM outbox_relays),
                        (SELECT count(*) FROM outbox_partitions WHERE owner IS NOT NULL),
                        (SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                            AND application_name = 'outbox-relay-listen')",
                    &[],
                )
                .await
                .unwrap();
            let wants: Option<bool> = row.get(0);
            let owned: i64 = row.get(1);
            let listening: i64 = row.get(2);
            (wants == Some(true) && owned == 64 && listening == 1).then_some(())
        },
    )
    .await;
    let _ = db;
}

/// With --no-listen, events arrive within about one poll interval. The bound leaves room
/// for a busy 2-core machine (seen: 1.6 s for a 300 ms poll under a load average of 20) and
/// still fails a relay that does not poll (without LISTEN and a poll, nothing would wake
/// it: the events would never arrive, or only after a lease takeover).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_listen_the_poll_interval_bounds_latency() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let mut config = test_config(&broker);
    config.listen = false;
    let poll = Duration::from_millis(1000);
    config.poll_interval = poll;
    let relay = InProcessRelay::start(&db, config);
    let client = db.client().await;
    crate::support::wait_leased(&client).await;
    let listening: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'outbox-relay-listen'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(listening, 0, "no LISTEN connection with --no-listen");
    let mut worst = Duration::ZERO;
    for round in 0..5 {
        let sent = std::time::Instant::now();
        db.insert(&client, 1, 1).await;
        broker.wait_count(round + 1, Duration::from_secs(15)).await;
        worst = worst.max(broker.received()[round].at - sent);
    }
    relay.stop().await;
    assert!(
        worst < poll * 5,
        "worst latency {worst:?} with a {poll:?} poll"
    );
}

/// An unroutable row is retried, never marked dispatched, parked after max attempts with
/// the exchange and routing key in its reason; routable rows keep flowing. An oversized row
/// is parked at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_and_oversized_rows_are_parked_while_others_flow() {
    let db = TestDb::new().await;
    let broker = Broker::new("order.#").await;
    let mut config = test_config(&broker);
    config.max_attempts = std::num::NonZeroU32::new(3).unwrap();
    config.max_message_bytes = std::num::NonZeroUsize::new(4096).unwrap();
    let relay = InProcessRelay::start(&db, config);
    let client = db.client().await;
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('ghost', 'g1', 'haunted', '{}'),
                    ('order', 'big', 'created', jsonb_build_object('blob', repeat('x', 10000)))",
            &[],
        )
        .await
        .unwrap();
    let routable = db.insert(&client, 200, 10).await;
    broker.wait_count(200, Duration::from_secs(30)).await;
    let row = crate::support::wait_for("ghost row parked", Duration::from_secs(30), || async {
        client
            .query_opt(
                "SELECT attempts, last_error, dispatched_at IS NULL FROM outbox_events
                  WHERE aggregate_type = 'ghost' AND parked_at IS NOT NULL",
                &[],
            )
            .await
            .unwrap()
    })
    .await;
    let (attempts, error, undispatched): (i32, String, bool) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(attempts, 3);
    assert!(undispatched);
    assert!(
        error.contains(&broker.exchange) && error.contains("ghost.haunted"),
        "{error}"
    );
    let big = client
        .query_one(
            "SELECT attempts, last_error, parked_at IS NOT NULL, dispatched_at IS NULL FROM outbox_events WHERE aggregate_id = 'big'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(big.get::<_, i32>(0), 1, "parked at the first attempt");
    assert!(big.get::<_, String>(1).contains("too large"));
    assert!(big.get::<_, bool>(2) && big.get::<_, bool>(3));
    relay.stop().await;
    let received = broker.received();
    check(&routable, &received).assert_clean();
    assert_eq!(
        received.len(),
        200,
        "neither the ghost nor the big row was delivered"
    );
}
