//! Relay core under faults: processes killed, connections cut, SIGTERM, bad configuration.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use lapin::options::QueueDeleteOptions;
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use outbox_relay::relay::Deps;
use outbox_testkit::postgres::PrivatePostgres;

use crate::support::checker::check;
use crate::support::process::{RelayProcess, run_to_end};
use crate::support::{
    Broker, InProcessRelay, TestDb, amqp_url, close_connections, test_config, unique, wait_for,
    wait_leased,
};

fn relay_args(db: &TestDb, broker: &Broker, extra: &[&str]) -> Vec<String> {
    crate::support::process::test_relay_args(&db.url(), &broker.exchange, extra)
}

/// Inserts `total` events in transactions of `per_tx`, pausing `pause` between them, while
/// the test does other things.
fn produce(
    db: &TestDb,
    total: usize,
    per_tx: usize,
    pause: Duration,
) -> tokio::task::JoinHandle<Vec<uuid::Uuid>> {
    let target = db.target.clone();
    let schema = db.schema.clone();
    tokio::spawn(async move {
        let client = target.connect(&schema, "outbox-it-producer").await.unwrap();
        let mut ids = Vec::with_capacity(total);
        let mut i = 0;
        while ids.len() < total {
            let rows = client
                .query(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                     SELECT 'order', 'k' || ((g + $2) % 200), 'created', jsonb_build_object('n', g + $2)
                       FROM generate_series(1, $1::int) AS g RETURNING event_id",
                    &[&(per_tx as i32), &(i as i32)],
                )
                .await
                .unwrap();
            ids.extend(rows.iter().map(|r| r.get::<_, uuid::Uuid>(0)));
            i += per_tx;
            tokio::time::sleep(pause).await;
        }
        ids
    })
}

async fn all_dispatched(db: &TestDb, limit: Duration) {
    let client = db.client().await;
    wait_for("all rows dispatched", limit, || async {
        (db.count(&client, "dispatched_at IS NULL").await == 0).then_some(())
    })
    .await;
}

/// SIGKILL of the relay process in the middle of a 20,000-event stream, then a restart:
/// every event delivered at least once, none lost, all rows dispatched, order kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_then_restart_loses_nothing() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let args = relay_args(&db, &broker, &[]);
    let name = unique("sigkill");
    let mut relay = RelayProcess::start(&name, &args);
    let producer = produce(&db, 20_000, 50, Duration::from_millis(5));
    broker.wait_count(5_000, Duration::from_secs(60)).await;
    relay.signal("KILL");
    relay.wait(Duration::from_secs(10)).await;
    let mut relay = RelayProcess::start(&name, &args);
    let committed = producer.await.unwrap();
    broker.wait_all(&committed, Duration::from_secs(120)).await;
    all_dispatched(&db, Duration::from_secs(30)).await;
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));
    let report = check(&committed, &broker.received());
    report.assert_clean();
}

/// The broker closes the relay's connection, then Postgres terminates its sessions, in the
/// middle of a stream: the relay recovers by itself and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_mid_stream_recover_without_loss() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let name = unique("cut");
    let relay = InProcessRelay::start_named(&db, test_config(&broker), &name);
    let producer = produce(&db, 12_000, 40, Duration::from_millis(10));
    broker.wait_count(2_000, Duration::from_secs(60)).await;
    let closed = close_connections(&relay.identity.connection_name).await;
    assert_eq!(
        closed, 1,
        "the relay's AMQP connection is found by its name"
    );
    // It publishes again after the cut, then loses its Postgres sessions mid-stream.
    let seen = broker.count();
    broker
        .wait_count((seen + 1_000).min(11_000), Duration::from_secs(60))
        .await;
    let killed = db.terminate_relay_connections("outbox-relay%").await;
    assert!(killed >= 1, "relay sessions terminated");
    let committed = producer.await.unwrap();
    broker.wait_all(&committed, Duration::from_secs(120)).await;
    all_dispatched(&db, Duration::from_secs(30)).await;
    relay.stop().await;
    let report = check(&committed, &broker.received());
    report.assert_clean();
}

/// SIGTERM in the middle of a stream: exit 0 within the shutdown timeout, every acked row
/// marked, so a relay started afterwards publishes nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_stream_exits_cleanly_and_publishes_nothing_twice() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let client = db.client().await;
    let committed = db.insert(&client, 20_000, 500).await;
    let args = relay_args(&db, &broker, &["--shutdown-timeout", "10s"]);
    let name = unique("sigterm");
    let mut relay = RelayProcess::start(&name, &args);
    broker.wait_count(3_000, Duration::from_secs(60)).await;
    relay.signal("TERM");
    let started = std::time::Instant::now();
    assert_eq!(
        relay.wait(Duration::from_secs(15)).await,
        Some(0),
        "log: {}",
        relay.log_text()
    );
    assert!(started.elapsed() < Duration::from_secs(11));
    let dispatched = db.count(&client, "dispatched_at IS NOT NULL").await;
    assert!(
        dispatched > 0 && dispatched < 20_000,
        "stopped mid-stream ({dispatched})"
    );
    // Everything the broker has is marked: wait until deliveries settle, compare.
    wait_for("deliveries settle", Duration::from_secs(10), || async {
        let a = broker.count();
        tokio::time::sleep(Duration::from_millis(300)).await;
        (broker.count() == a).then_some(())
    })
    .await;
    assert_eq!(
        broker.count() as i64,
        dispatched,
        "every published row was marked before exit"
    );
    let mut relay = RelayProcess::start(&name, &args);
    broker.wait_all(&committed, Duration::from_secs(120)).await;
    all_dispatched(&db, Duration::from_secs(30)).await;
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));
    let report = check(&committed, &broker.received());
    report.assert_clean();
    assert_eq!(report.duplicates, 0, "{report:?}");
}

/// A broker that nacks every publish (here a second bound queue that is always full, with
/// overflow reject-publish) gets a new session after a confirm timeout of nothing but nacks:
/// a channel that lost track of a queue's leader can nack for good, and only a new session
/// gets past it. Nothing is marked while the nacks last; once the full queue is gone every
/// event is marked and has arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_only_gets_nacks_is_replaced() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let (ch, full) = broker.refusing_queue().await;
    let client = db.client().await;
    let committed = db.insert(&client, 500, 100).await;
    let mut relay = RelayProcess::start(&unique("nacked"), &relay_args(&db, &broker, &[]));
    wait_for(
        "a new session after a confirm timeout (5 s) of nacks only",
        Duration::from_secs(60),
        || async {
            let log = relay.log_text();
            (log.contains("the broker nacked every publish for 5s")
                && log.contains("amqp session open generation=2"))
            .then_some(())
        },
    )
    .await;
    // The other queue took copies (a nack does not mean "not routed"), so the consumer may
    // see duplicates; a nacked row is never marked.
    assert_eq!(db.count(&client, "dispatched_at IS NOT NULL").await, 0);
    ch.queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    broker.wait_all(&committed, Duration::from_secs(60)).await;
    all_dispatched(&db, Duration::from_secs(30)).await;
    relay.signal("TERM");
    assert_eq!(relay.wait(Duration::from_secs(20)).await, Some(0));
    check(&committed, &broker.received()).assert_clean();
}

/// Bad configuration: exit 2 with one line naming the flag.
#[tokio::test]
async fn bad_configuration_exits_2_with_one_line() {
    for (args, flag) in [
        (vec!["run", "--batch-size", "0"], "--batch-size"),
        (
            vec!["run", "--database-url", "postgres://[::1"],
            "--database-url",
        ),
        (vec!["run", "--amqp-url", "mqtt://x"], "--amqp-url"),
        (vec!["run", "--poll-interval", "often"], "--poll-interval"),
        (vec!["run", "--schema", "Robert'); DROP"], "--schema"),
        (
            vec!["run", "--shutdown-timeout", "10s"],
            "--shutdown-timeout",
        ),
        (vec!["run", "--no-such-flag"], "--no-such-flag"),
    ] {
        let (code, _out, err) = run_to_end(&args, &[]).await;
        assert_eq!(code, 2, "{args:?}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: one line, got {err:?}"
        );
        assert!(err.contains(flag), "{args:?}: names {flag}: {err}");
        assert!(!err.contains("panicked") && !err.contains("backtrace"));
    }
    // The same through the environment.
    let (code, _, err) = run_to_end(&["run"], &[("OUTBOX_BATCH_SIZE", "0")]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--batch-size"));
}

/// Boolean variables take the usual spellings (`OUTBOX_NO_DECLARE=1` used to exit 2 with
/// "invalid value '1'"): with them set, the run goes on to the next check, a bad batch
/// size; a value that is no boolean names its flag.
#[tokio::test]
async fn boolean_variables_take_1_yes_and_on() {
    let booleans = [
        ("OUTBOX_NO_DECLARE", "1"),
        ("OUTBOX_NO_MIGRATE", "yes"),
        ("OUTBOX_NO_LISTEN", "on"),
        ("OUTBOX_CLOUDEVENTS", "0"),
    ];
    let (code, _, err) = run_to_end(&["run", "--batch-size", "0"], &booleans).await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--batch-size") && !err.contains("invalid value"),
        "the booleans were accepted: {err}"
    );
    let (code, _, err) = run_to_end(&["run"], &[("OUTBOX_NO_DECLARE", "maybe")]).await;
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("--no-declare"), "{err}");
}

/// Marks commit without waiting for their WAL flush. A Postgres crash that loses them
/// leaves their rows pending: the relay publishes them again with the numbers they had, and
/// nothing is lost. On a server of its own, whose WAL writer is paused so that nothing but
/// a commit that waits for its flush writes the marks out; then that process is killed,
/// which Postgres handles as a crash (every session ends, recovery from the WAL on disk).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_a_postgres_crash_loses_are_published_again_with_their_seq() {
    let dir = std::env::temp_dir().join(format!("outbox-it-pgcrash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pg = PrivatePostgres::start(&dir)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let target = DbTarget::parse(&pg.url()).unwrap();
    let schema = Schema::default();
    let mut client = target.connect(&schema, "outbox-it").await.unwrap();
    outbox_kit::schema::migrate(&mut client, &schema)
        .await
        .unwrap();
    let broker = Broker::new("#").await;
    let mut config = test_config(&broker);
    // No write of the relay's own commits its marks to disk meanwhile: no wake-up flag
    // (LISTEN off), and no lease round for 40 s after the first.
    config.listen = false;
    config.lease = Duration::from_secs(120);
    let deps = Deps {
        pool: target.pool(&schema, "outbox-relay", 8),
        db: target.clone(),
        schema: schema.clone(),
        amqp: AmqpTarget::parse(&amqp_url()).unwrap(),
        telemetry: Default::default(),
    };
    let relay = InProcessRelay::start_with(deps, config, &unique("pgcrash"));
    wait_leased(&client).await;

    let walwriter: i32 = client
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    signal(walwriter, "STOP");
    let rows = client
        .query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'k' || (g % 3), 'created', jsonb_build_object('n', g)
               FROM generate_series(1, 30) AS g
             RETURNING event_id",
            &[],
        )
        .await
        .unwrap();
    let committed: Vec<uuid::Uuid> = rows.iter().map(|r| r.get(0)).collect();
    broker.wait_all(&committed, Duration::from_secs(60)).await;
    wait_for("every row marked", Duration::from_secs(30), || async {
        (pending(&client).await? == 0).then_some(())
    })
    .await;
    let first = broker.count();

    signal(walwriter, "KILL");
    let client = wait_for(
        "Postgres back after the crash",
        Duration::from_secs(60),
        || {
            let target = target.clone();
            let schema = schema.clone();
            async move {
                let c = target.connect(&schema, "outbox-it").await.ok()?;
                c.query_one("SELECT 1", &[]).await.ok()?;
                Some(c)
            }
        },
    )
    .await;
    let lost = pending(&client).await.expect("count pending rows");
    assert!(
        lost > 0,
        "the crash lost no mark: marks waited for their WAL flush, or something flushed them"
    );

    // Published again, each with the number it had; then marked for good.
    wait_for(
        "lost marks published again",
        Duration::from_secs(60),
        || async { (broker.count() >= first + lost as usize).then_some(()) },
    )
    .await;
    wait_for(
        "every row marked again",
        Duration::from_secs(60),
        || async { (pending(&client).await? == 0).then_some(()) },
    )
    .await;
    relay.stop().await;
    let received = broker.received();
    let mut seqs: HashMap<String, HashSet<Option<i64>>> = HashMap::new();
    for r in &received {
        seqs.entry(r.message_id.clone())
            .or_default()
            .insert(r.seq());
    }
    let renumbered: Vec<_> = seqs.iter().filter(|(_, s)| s.len() > 1).collect();
    assert!(
        renumbered.is_empty(),
        "published again with another seq: {renumbered:?}"
    );
    let report = check(&committed, &received);
    report.assert_clean();
    assert_eq!(report.duplicates as i64, lost, "{report:?}");
    let numbered: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_events e
              WHERE e.seq IS NOT NULL AND e.seq = (SELECT count(*) FROM outbox_events x
                  WHERE x.aggregate_id = e.aggregate_id AND x.id <= e.id)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(numbered, 30, "each key numbered 1, 2, 3, ... in id order");
}

/// Rows not yet marked dispatched; `None` while the server cannot answer.
async fn pending(client: &tokio_postgres::Client) -> Option<i64> {
    client
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE dispatched_at IS NULL",
            &[],
        )
        .await
        .ok()
        .map(|r| r.get(0))
}

fn signal(pid: i32, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{name} {pid}");
}
