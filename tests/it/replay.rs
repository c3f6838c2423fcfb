//! `outbox-relay replay`, end to end: events dispatched by a real relay are re-published by
//! the binary to one queue that no binding reaches, with the original message and a replay
//! header; a dry run counts; a replay killed or stopped mid-way resumes with nothing
//! missing; a range that reaches into rows retention deleted is refused.

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::time::Duration;

use lapin::types::AMQPValue;
use tokio::process::{Child, Command};
use tokio_postgres::Client;

use crate::support::process::{binary, run_to_end};
use crate::support::{
    Broker, InProcessRelay, Received, TestDb, amqp_url, test_config, wait_for, wait_for_explained,
};

/// Inserts `sql` (an INSERT into outbox_events) and waits until a relay dispatched every
/// row and `broker` received them all; returns the rows' event ids.
async fn dispatched(db: &TestDb, client: &Client, broker: &Broker, sql: &str) -> Vec<String> {
    let relay = InProcessRelay::start(db, test_config(broker));
    let rows = client.query(sql, &[]).await.unwrap();
    let ids: Vec<String> = rows
        .iter()
        .map(|r| r.get::<_, uuid::Uuid>(0).to_string())
        .collect();
    let want = broker.count() + ids.len();
    broker.wait_count(want, Duration::from_secs(60)).await;
    wait_for(
        "rows marked dispatched",
        Duration::from_secs(30),
        || async { (db.count(client, "dispatched_at IS NULL").await == 0).then_some(()) },
    )
    .await;
    relay.stop().await;
    ids
}

/// `outbox-relay replay` arguments against the test's database and the local broker.
fn replay_args<'a>(db_url: &'a str, amqp: &'a str, name: &'a str, queue: &'a str) -> Vec<&'a str> {
    vec![
        "replay",
        "--database-url",
        db_url,
        "--amqp-url",
        amqp,
        "--name",
        name,
        "--queue",
        queue,
    ]
}

/// Runs the binary with `args`, with a deadline.
async fn replay(args: &[&str]) -> (i32, String, String) {
    tokio::time::timeout(Duration::from_secs(120), run_to_end(args, &[]))
        .await
        .expect("replay ends within 120 s")
}

fn by_id(messages: &[Received]) -> HashMap<String, Received> {
    messages
        .iter()
        .map(|m| (m.message_id.clone(), m.clone()))
        .collect()
}

/// A replay re-publishes exactly the selected events, each the message the relay published
/// (message_id, type, body, headers and seq) plus `x-outbox-replay: true`, to the one queue;
/// the relay's subscribers see nothing. A dry run counts and changes nothing; the same
/// name run again does nothing; a missing queue is refused naming --queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_republishes_the_selection_to_one_queue() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let broker = Broker::new("#").await;
    let shipped = dispatched(
        &db,
        &client,
        &broker,
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers)
         SELECT 'order', 'k' || (g % 3), CASE WHEN g % 2 = 0 THEN 'shipped' ELSE 'created' END,
                jsonb_build_object('n', g), jsonb_build_object('tenant', 'acme')
           FROM generate_series(1, 20) AS g
         UNION ALL
         SELECT 'invoice', 'i' || g, 'shipped', jsonb_build_object('n', g), '{}'
           FROM generate_series(1, 5) AS g
         RETURNING event_id, aggregate_type, event_type",
    )
    .await;
    assert_eq!(shipped.len(), 25);
    let selected: HashSet<String> = client
        .query(
            "SELECT event_id::text FROM outbox_events
              WHERE aggregate_type = 'order' AND event_type = 'shipped'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(selected.len(), 10);
    let originals = by_id(&broker.received());
    let late = Broker::new("").await; // a queue no binding reaches
    let (url, amqp) = (db.url(), amqp_url());
    let mut args = replay_args(&url, &amqp, "late-shipped", &late.queue);
    args.extend(["--aggregate-type", "order", "--event-type", "shipped"]);

    let mut dry = args.clone();
    dry.push("--dry-run");
    let (code, out, err) = replay(&dry).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("would re-publish 10 events"), "{out}");
    let recorded: i64 = client
        .query_one("SELECT count(*) FROM outbox_replays", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, 0, "a dry run records nothing");

    let (code, out, err) = replay(&args).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("finished, 10 events re-published"), "{out}");
    assert!(err.contains("10 of 10 events"), "a progress line: {err}");
    late.wait_count(10, Duration::from_secs(30)).await;
    let replayed = late.received();
    let got: HashSet<String> = replayed.iter().map(|m| m.message_id.clone()).collect();
    assert_eq!(got, selected);
    for m in &replayed {
        let first = &originals[&m.message_id];
        assert_eq!(
            m.headers.get("x-outbox-replay"),
            Some(&AMQPValue::Boolean(true))
        );
        let mut headers = m.headers.clone();
        headers.remove("x-outbox-replay");
        assert_eq!(headers, first.headers, "{}", m.message_id);
        assert_eq!(m.seq(), first.seq());
        assert_eq!(m.body, first.body);
        assert_eq!(m.kind, first.kind);
        assert_eq!(m.content_type, first.content_type);
        assert_eq!(m.timestamp, first.timestamp);
        assert_eq!(m.delivery_mode, Some(2));
        assert_eq!(m.routing_key, late.queue);
    }
    // Per key in seq order.
    let mut last: HashMap<(String, String), i64> = HashMap::new();
    for m in &replayed {
        let seq = m.seq().unwrap();
        let before = last.insert(m.key(), seq);
        assert!(
            before.is_none_or(|b| b < seq),
            "{:?} after {before:?}",
            m.key()
        );
    }

    // The same name again: finished, nothing sent.
    let (code, out, err) = replay(&args).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("finished already"), "{out}");
    // The same name with another selection: refused, naming what differs.
    let mut other = replay_args(&url, &amqp, "late-shipped", &late.queue);
    other.extend(["--aggregate-type", "invoice"]);
    let (code, _, err) = replay(&other).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--aggregate-type"), "{err}");

    // An id range and one key.
    let bounds = client
        .query_one(
            "SELECT min(id), max(id) FROM outbox_events WHERE aggregate_type = 'invoice'",
            &[],
        )
        .await
        .unwrap();
    let (lo, hi): (i64, i64) = (bounds.get(0), bounds.get(1));
    let (lo, hi) = (lo.to_string(), (hi - 1).to_string());
    let mut range = replay_args(&url, &amqp, "invoices", &late.queue);
    range.extend(["--from-id", &lo, "--to-id", &hi]);
    let (code, out, err) = replay(&range).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("finished, 4 events"), "{out}");
    late.wait_count(14, Duration::from_secs(30)).await;

    // A queue that does not exist: the broker returns the message; refused naming --queue.
    let (code, _, err) = replay(&replay_args(&url, &amqp, "nowhere", "no-such-queue-here")).await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--queue") && err.contains("no-such-queue-here"),
        "{err}"
    );

    // The relay's own queue saw none of it.
    assert_eq!(broker.count(), 25);
}

/// A replay process started in the background, its stdout and stderr in files.
struct Running {
    child: Child,
    out: std::path::PathBuf,
}

impl Running {
    fn start(args: &[&str], name: &str) -> Running {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("relay-logs");
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join(format!("{name}.out"));
        let err = std::fs::File::create(dir.join(format!("{name}.err"))).unwrap();
        let child = Command::new(binary())
            .args(args)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(err)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn outbox-relay replay");
        Running { child, out }
    }

    async fn exit_code(&mut self) -> Option<i32> {
        tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("exits within 60 s")
            .unwrap()
            .code()
    }
}

async fn published(client: &Client, name: &str) -> i64 {
    client
        .query_opt(
            "SELECT published FROM outbox_replays WHERE name = $1",
            &[&name],
        )
        .await
        .unwrap()
        .map_or(0, |r| r.get(0))
}

/// Stopped by SIGTERM, then killed by SIGKILL mid-replay, a replay run again under its name
/// goes on from its recorded progress: every selected event arrives, and what is re-sent
/// twice is at most the batches in flight when it was killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_resumes_after_sigterm_and_sigkill() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let broker = Broker::new("#").await;
    let events = dispatched(
        &db,
        &client,
        &broker,
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'k' || (g % 50), 'created', jsonb_build_object('n', g)
           FROM generate_series(1, 1500) AS g
         RETURNING event_id",
    )
    .await;
    let late = Broker::new("").await;
    let (url, amqp) = (db.url(), amqp_url());
    let name = "restore";
    let mut args = replay_args(&url, &amqp, name, &late.queue);
    args.extend(["--rate", "300", "--batch-size", "50"]);

    // SIGTERM: the batch in flight is confirmed and recorded, then exit 0.
    let mut first = Running::start(&args, &crate::support::unique("replay-term"));
    wait_for(
        "a few batches recorded",
        Duration::from_secs(60),
        || async { (published(&client, name).await >= 200).then_some(()) },
    )
    .await;
    let pid = first.child.id().unwrap().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(first.exit_code().await, Some(0));
    let out = std::fs::read_to_string(&first.out).unwrap();
    assert!(out.contains("stopped after id"), "{out}");
    let after_term = published(&client, name).await;
    assert!(after_term < 1500, "stopped mid-way ({after_term})");
    wait_for(
        "the stopped run's messages",
        Duration::from_secs(30),
        || async { (late.count() as i64 >= after_term).then_some(()) },
    )
    .await;

    // SIGKILL mid-replay: whatever was confirmed and not recorded is sent again.
    let mut second = Running::start(&args, &crate::support::unique("replay-kill"));
    wait_for("more batches recorded", Duration::from_secs(60), || async {
        (published(&client, name).await >= after_term + 200).then_some(())
    })
    .await;
    second.child.start_kill().unwrap();
    assert_eq!(second.exit_code().await, None, "killed by a signal");
    let after_kill = published(&client, name).await;
    assert!(after_kill < 1500, "killed mid-way ({after_kill})");

    // Run again: it finishes from where it was recorded.
    let (code, out, err) = replay(&args).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("finished, 1500 events re-published"), "{out}");
    late.wait_count(1500, Duration::from_secs(60)).await;
    let got: HashSet<String> = late
        .received()
        .iter()
        .map(|m| m.message_id.clone())
        .collect();
    let want: HashSet<String> = events.into_iter().collect();
    assert_eq!(got.len(), 1500);
    assert_eq!(got, want, "every event arrived");
    let resent = late.count() - 1500;
    // At most the killed run's batch in flight: a batch is recorded before the next one
    // is published.
    assert!(resent <= 50, "{resent} re-sent");
}

/// Rows retention deleted cannot be replayed: a range reaching into them is refused with
/// how much is gone, and a range after them goes ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_refuses_a_range_retention_deleted() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let broker = Broker::new("#").await;
    dispatched(
        &db,
        &client,
        &broker,
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'k' || g, 'created', '{}' FROM generate_series(1, 20) AS g
         RETURNING event_id",
    )
    .await;
    // The relay's own retention sweep, with an age every dispatched row has passed.
    let pool = db.pool();
    let stop = tokio_util::sync::CancellationToken::new();
    wait_for(
        "retention deleted the 20 rows",
        Duration::from_secs(30),
        || async {
            outbox_relay::relay::retention::sweep(&pool, Duration::from_millis(1), &stop)
                .await
                .unwrap();
            (db.count(&client, "true").await == 0).then_some(())
        },
    )
    .await;
    let newest_gone: i64 = client
        .query_one("SELECT deleted_to_id FROM outbox_retention_horizon", &[])
        .await
        .unwrap()
        .get(0);
    let kept = dispatched(
        &db,
        &client,
        &broker,
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'k' || g, 'created', '{}' FROM generate_series(1, 5) AS g
         RETURNING event_id",
    )
    .await;
    let late = Broker::new("").await;
    let (url, amqp) = (db.url(), amqp_url());

    let (code, _, err) = replay(&replay_args(&url, &amqp, "all", &late.queue)).await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("20 dispatched events are gone")
            && err.contains(&format!("up to id {newest_gone}"))
            && err.contains(&format!("--from-id {}", newest_gone + 1)),
        "{err}"
    );
    let mut dry = replay_args(&url, &amqp, "all", &late.queue);
    dry.push("--dry-run");
    assert_eq!(replay(&dry).await.0, 2, "a dry run is refused the same way");
    let mut early = replay_args(&url, &amqp, "early", &late.queue);
    early.extend(["--from-id", "1"]);
    assert_eq!(replay(&early).await.0, 2);

    let from = (newest_gone + 1).to_string();
    let mut after = replay_args(&url, &amqp, "after", &late.queue);
    after.extend(["--from-id", &from]);
    let (code, out, err) = replay(&after).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("finished, 5 events"), "{out}");
    late.wait_count(5, Duration::from_secs(30)).await;
    let got: HashSet<String> = late
        .received()
        .iter()
        .map(|m| m.message_id.clone())
        .collect();
    assert_eq!(got, kept.into_iter().collect::<HashSet<_>>());
}

/// Records each applied event with its key and seq, in apply order.
struct Applies;

impl outbox_kit::consumer::Handler for Applies {
    async fn handle(
        &self,
        cx: &outbox_kit::consumer::runner::Context<'_>,
        msg: &outbox_kit::consumer::Message,
    ) -> Result<(), outbox_kit::consumer::HandlerError> {
        cx.tx()
            .execute(
                "INSERT INTO it_applied (event_id, aggregate_id, seq) VALUES ($1, $2, $3)",
                &[&msg.event_id, &msg.aggregate_id, &msg.seq],
            )
            .await?;
        Ok(())
    }
}

/// An ordered consumer group created after the events were dispatched takes a replay through
/// its intake queue, as docs/operating.md says: two members apply every event once, each key
/// in seq order, with no gap recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ordered_group_takes_a_replay_through_its_intake() {
    use crate::support::kit::{self, group_config, wait_group_ready};
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE it_applied (n bigint GENERATED ALWAYS AS IDENTITY,
                 event_id uuid NOT NULL, aggregate_id text NOT NULL, seq bigint)",
        )
        .await
        .unwrap();
    let broker = Broker::new("#").await;
    dispatched(
        &db,
        &client,
        &broker,
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'k' || (g % 10), 'created', jsonb_build_object('n', g)
           FROM generate_series(1, 200) AS g
         RETURNING event_id",
    )
    .await;
    let cfg = group_config(&broker.exchange, 4);
    let member = |name: &str| {
        let mut c = cfg.clone();
        c.connection_name = format!("{} {name}", cfg.connection_name);
        kit::Running::start(&db, c, std::sync::Arc::new(Applies))
    };
    let (a, b) = (member("a"), member("b"));
    wait_group_ready(&cfg).await;

    let (url, amqp) = (db.url(), amqp_url());
    let intake = cfg.intake_queue();
    let (code, out, err) = replay(&replay_args(&url, &amqp, "group", &intake)).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("finished, 200 events"), "{out}");
    wait_for_explained(
        "200 events applied",
        Duration::from_secs(120),
        || async {
            let n: i64 = client
                .query_one("SELECT count(*) FROM it_applied", &[])
                .await
                .ok()?
                .get(0);
            (n >= 200).then_some(())
        },
        || kit::group_state(&client, &cfg),
    )
    .await;
    a.stop().await;
    b.stop().await;
    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    for r in client
        .query("SELECT aggregate_id, seq FROM it_applied ORDER BY n", &[])
        .await
        .unwrap()
    {
        per_key.entry(r.get(0)).or_default().push(r.get(1));
    }
    assert_eq!(per_key.len(), 10);
    for (key, seqs) in &per_key {
        assert_eq!(*seqs, (1..=20).collect::<Vec<i64>>(), "key {key}");
    }
    let gaps: i64 = client
        .query_one("SELECT count(*) FROM outbox_inbox_gaps", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(gaps, 0);
    kit::delete_group_topology(&cfg).await;
}
