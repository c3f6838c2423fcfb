//! Scale-out: several relays share the work, per-key order holds through failures, poison
//! rows are parked and re-driven by the operator commands.

use std::collections::HashMap;
use std::time::Duration;

use outbox_relay::relay::OnPark;

use crate::support::checker::check;
use crate::support::process::{RelayProcess, run_to_end};
use crate::support::{Broker, InProcessRelay, TestDb, test_config, unique, wait_for};

/// `n` events over `keys` keys from `producers` connections, in small transactions with a
/// pause between them. Returns the committed event ids.
async fn produce(
    db: &TestDb,
    n: usize,
    keys: usize,
    producers: usize,
    pause: Duration,
) -> Vec<uuid::Uuid> {
    let mut tasks = Vec::new();
    for p in 0..producers {
        let client = db.client().await;
        let share = n / producers;
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::with_capacity(share);
            let per_tx = 25;
            let mut i = 0;
            while i < share {
                let rows = client
                    .query(
                        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                         SELECT 'acct', 'k' || ((g * 7919 + $3) % $2), 'changed', jsonb_build_object('p', $4::int, 'n', g)
                           FROM generate_series($1::int, $1::int + 24) AS g RETURNING event_id",
                        &[&(i as i32), &(keys as i32), &(p as i32 * 104_729), &(p as i32)],
                    )
                    .await
                    .unwrap();
                ids.extend(rows.iter().map(|r| r.get::<_, uuid::Uuid>(0)));
                i += per_tx;
                tokio::time::sleep(pause).await;
            }
            ids
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

async fn wait_dispatched(db: &TestDb, limit: Duration) {
    let client = db.client().await;
    wait_for("all rows dispatched", limit, || async {
        (db.count(&client, "dispatched_at IS NULL AND parked_at IS NULL")
            .await
            == 0)
            .then_some(())
    })
    .await;
}

/// How many partitions each live relay holds.
async fn holdings(client: &tokio_postgres::Client) -> HashMap<String, i64> {
    client
        .query(
            "SELECT owner, count(*) FROM outbox_partitions WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Three relays, 30,000 events over 2,000 keys from 4 producers: nothing lost, nothing
/// unexpected, no order violation, and each relay published a share.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_relays_share_the_work_in_order() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let relays: Vec<InProcessRelay> = (0..3)
        .map(|_| InProcessRelay::start(&db, test_config(&broker)))
        .collect();
    let client = db.client().await;
    wait_for(
        "the three relays share the partitions",
        Duration::from_secs(30),
        || async {
            let h = holdings(&client).await;
            (h.len() == 3 && h.values().sum::<i64>() == 64 && h.values().all(|n| *n >= 20))
                .then_some(())
        },
    )
    .await;
    let committed = produce(&db, 30_000, 2_000, 4, Duration::from_millis(3)).await;
    broker.wait_all(&committed, Duration::from_secs(180)).await;
    wait_dispatched(&db, Duration::from_secs(30)).await;
    // Each relay reports what it published at its next heartbeat.
    let shares: Vec<i64> = wait_for(
        "published counts reported",
        Duration::from_secs(10),
        || async {
            let rows = client
                .query("SELECT published FROM outbox_relays", &[])
                .await
                .unwrap();
            let shares: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
            (shares.len() == 3 && shares.iter().sum::<i64>() >= 30_000).then_some(shares)
        },
    )
    .await;
    for r in relays {
        r.stop().await;
    }
    let report = check(&committed, &broker.received());
    report.assert_clean();
    assert!(
        shares.iter().all(|s| *s >= 3_000),
        "each relay published a share: {shares:?}"
    );
}

/// While three relay processes share a stream: one is SIGKILLed and restarted, one is
/// SIGSTOPped past its lease and then continued, one loses its Postgres sessions. Nothing is
/// lost, nothing unexpected, per-key order holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relays_killed_stopped_and_cut_keep_order_and_lose_nothing() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let args = |app: &str| -> Vec<String> {
        let url = format!("{}?application_name={app}", db.url());
        crate::support::process::test_relay_args(&url, &broker.exchange, &[])
    };
    let name = unique("trio");
    let mut a = RelayProcess::start(&format!("{name}-a"), &args("relay_a"));
    let b = RelayProcess::start(&format!("{name}-b"), &args("relay_b"));
    let mut c = RelayProcess::start(&format!("{name}-c"), &args("relay_c"));
    let client = db.client().await;
    wait_for(
        "three relays hold partitions",
        Duration::from_secs(30),
        || async {
            let h = holdings(&client).await;
            (h.len() == 3 && h.values().all(|n| *n >= 20)).then_some(())
        },
    )
    .await;
    let producer = {
        let target = db.target.clone();
        let schema = db.schema.clone();
        tokio::spawn(async move {
            let db = TestDb {
                name: String::new(),
                target,
                schema,
            };
            produce(&db, 30_000, 2_000, 4, Duration::from_millis(15)).await
        })
    };
    broker.wait_count(3_000, Duration::from_secs(60)).await;

    // SIGKILL one and start it again.
    a.signal("KILL");
    a.wait(Duration::from_secs(10)).await;
    let mut a = RelayProcess::start(&format!("{name}-a2"), &args("relay_a"));

    // SIGSTOP another past its lease: the others take its partitions over.
    let b_id: String = client
        .query_one(
            "SELECT relay_id FROM outbox_relays WHERE pid = $1",
            &[&(b.pid() as i32)],
        )
        .await
        .unwrap()
        .get(0);
    b.signal("STOP");
    wait_for(
        "the stopped relay's partitions taken over",
        Duration::from_secs(20),
        || async {
            let h = holdings(&client).await;
            (!h.contains_key(&b_id) && h.values().sum::<i64>() == 64).then_some(())
        },
    )
    .await;
    let seen = broker.count();
    broker
        .wait_count((seen + 1_000).min(29_000), Duration::from_secs(60))
        .await;
    b.signal("CONT");

    // Cut the third one's Postgres sessions.
    let killed = db.terminate_relay_connections("relay_c").await;
    assert!(killed >= 1);

    let committed = producer.await.unwrap();
    broker.wait_all(&committed, Duration::from_secs(180)).await;
    wait_dispatched(&db, Duration::from_secs(60)).await;
    for r in [&mut a, &mut c] {
        r.signal("TERM");
        assert_eq!(r.wait(Duration::from_secs(20)).await, Some(0));
    }
    let mut b = b;
    b.signal("TERM");
    assert_eq!(
        b.wait(Duration::from_secs(20)).await,
        Some(0),
        "log: {}",
        b.log_text()
    );
    let report = check(&committed, &broker.received());
    report.assert_clean();
}

/// 5,000 events of one key with three relays: delivered in seq order, 1..5000.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_key_is_delivered_in_seq_order() {
    let db = TestDb::new().await;
    let broker = Broker::new("#").await;
    let relays: Vec<InProcessRelay> = (0..3)
        .map(|_| InProcessRelay::start(&db, test_config(&broker)))
        .collect();
    let client = db.client().await;
    let committed = db.insert(&client, 5_000, 1).await;
    broker.wait_all(&committed, Duration::from_secs(120)).await;
    for r in relays {
        r.stop().await;
    }
    let received = broker.received();
    let report = check(&committed, &received);
    report.assert_clean();
    // First deliveries come in seq order 1, 2, 3, ...
    let mut seen = std::collections::HashSet::new();
    let firsts: Vec<i64> = received
        .iter()
        .filter(|r| seen.insert(r.message_id.clone()))
        .map(|r| r.seq().unwrap())
        .collect();
    assert_eq!(firsts, (1..=5_000).collect::<Vec<i64>>());
}

struct Poison {
    db: TestDb,
    broker: Broker,
    client: tokio_postgres::Client,
    /// Event ids of key "p" in insert order: routable, unroutable, routable.
    key_p: Vec<uuid::Uuid>,
    others: Vec<uuid::Uuid>,
}

/// Key "p": created, ghost (unroutable: the queue binds only `acct.created`), created;
/// plus 300 routable events of other keys.
async fn poison_setup(on_park: OnPark) -> (Poison, InProcessRelay) {
    let db = TestDb::new().await;
    let broker = Broker::new("acct.created").await;
    let mut config = test_config(&broker);
    config.max_attempts = std::num::NonZeroU32::new(4).unwrap();
    config.retry_min = Duration::from_millis(200);
    config.retry_max = Duration::from_millis(400);
    config.on_park = on_park;
    let relay = InProcessRelay::start(&db, config);
    let client = db.client().await;
    let mut key_p = Vec::new();
    for event_type in ["created", "ghost", "created"] {
        let id: uuid::Uuid = client
            .query_one(
                "SELECT outbox_enqueue('acct', 'p', $1, '{}')",
                &[&event_type],
            )
            .await
            .unwrap()
            .get(0);
        key_p.push(id);
    }
    let rows = client
        .query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'acct', 'o' || (g % 30), 'created', '{}' FROM generate_series(1, 300) g RETURNING event_id",
            &[],
        )
        .await
        .unwrap();
    let others = rows.iter().map(|r| r.get(0)).collect();
    (
        Poison {
            db,
            broker,
            client,
            key_p,
            others,
        },
        relay,
    )
}

impl Poison {
    fn arrived(&self, id: &uuid::Uuid) -> Option<crate::support::Received> {
        self.broker
            .received()
            .into_iter()
            .find(|r| r.message_id == id.to_string())
    }

    async fn parked(&self) -> tokio_postgres::Row {
        wait_for("the ghost event parked", Duration::from_secs(30), || async {
            self.client
                .query_opt(
                    "SELECT attempts, last_error, seq FROM outbox_events WHERE event_type = 'ghost' AND parked_at IS NOT NULL",
                    &[],
                )
                .await
                .unwrap()
        })
        .await
    }

    async fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let url = self.db.url();
        let mut all = args.to_vec();
        all.extend(["--database-url", url.as_str()]);
        run_to_end(&all, &[]).await
    }
}

/// `--on-park continue`: the poison row is parked after max attempts with its reason, the
/// key's later event is delivered after it, other keys never wait. A re-drive (after a
/// binding exists) publishes it with a new seq after the key's last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_with_continue_parks_and_the_key_goes_on() {
    let (t, relay) = poison_setup(OnPark::Continue).await;
    // Other keys flow while the poison row is still being retried.
    t.broker.wait_count(301, Duration::from_secs(30)).await;
    let not_yet: i64 = t
        .client
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE parked_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        not_yet, 0,
        "other keys did not wait for the poison row's attempts"
    );
    let parked = t.parked().await;
    assert_eq!(parked.get::<_, i32>(0), 4);
    assert!(parked.get::<_, String>(1).contains("acct.ghost"));
    let ghost_seq: i64 = parked.get(2);
    t.broker.wait_count(302, Duration::from_secs(30)).await;
    let third = t
        .arrived(&t.key_p[2])
        .expect("the key's later event went on");
    assert_eq!(
        third.seq(),
        Some(ghost_seq + 1),
        "consumers see the parked row's gap"
    );

    // status reports what we set up (once the last marks committed).
    wait_dispatched(&t.db, Duration::from_secs(10)).await;
    let (code, out, err) = t.cli(&["status", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["parked"], 1);
    assert_eq!(status["pending"], 0);
    assert_eq!(status["relays_alive"], 1);
    assert_eq!(
        status["relays"][0]["partitions"].as_array().unwrap().len(),
        64
    );
    let (code, out, _) = t
        .cli(&["parked", "list", "--event-type", "ghost", "--json"])
        .await;
    assert_eq!(code, 0);
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed[0]["event_id"], t.key_p[1].to_string());
    assert_eq!(listed[0]["attempts"], 4);
    assert!(listed[0]["reason"].as_str().unwrap().contains("unroutable"));

    // A dry run changes nothing.
    let (code, out, _) = t.cli(&["redrive", "--all-parked", "--dry-run"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("would re-drive 1") && out.contains("nothing changed"),
        "{out}"
    );
    assert_eq!(t.db.count(&t.client, "parked_at IS NOT NULL").await, 1);

    t.broker.bind("acct.ghost").await;
    let (code, out, _) = t
        .cli(&["redrive", "--event-id", &t.key_p[1].to_string()])
        .await;
    assert_eq!(code, 0);
    assert!(
        out.contains("re-drove 1 parked row(s) of 1 key(s) (1 key(s) get new seq"),
        "{out}"
    );
    t.broker.wait_count(303, Duration::from_secs(30)).await;
    relay.stop().await;
    let ghost = t.arrived(&t.key_p[1]).unwrap();
    assert_eq!(
        ghost.seq(),
        Some(ghost_seq + 2),
        "re-driven after the key's last seq"
    );
    let mut all = t.key_p.clone();
    all.extend(&t.others);
    check(&all, &t.broker.received()).assert_clean();
}

/// `--on-park block-key`: the key's later event waits while the poison row is parked;
/// after a binding exists and an operator re-drives, both arrive in order, gapless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_with_block_key_waits_for_the_operator() {
    let (t, relay) = poison_setup(OnPark::BlockKey).await;
    t.broker.wait_count(301, Duration::from_secs(30)).await;
    t.parked().await;
    // A later event of another key arriving proves the relay has polled past the park;
    // the poison key's third event must still not have gone.
    let marker: uuid::Uuid = t
        .client
        .query_one(
            "SELECT outbox_enqueue('acct', 'marker', 'created', '{}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    wait_for(
        "a later event of another key",
        Duration::from_secs(10),
        || async { t.arrived(&marker).map(|_| ()) },
    )
    .await;
    assert!(
        t.arrived(&t.key_p[2]).is_none(),
        "block-key holds the key's later events"
    );

    let (code, _, err) = t.cli(&["redrive"]).await;
    assert_eq!(code, 2, "no selector is bad arguments");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    t.broker.bind("acct.ghost").await;
    let (code, out, _) = t.cli(&["redrive", "--aggregate-id", "p"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("(0 key(s) get new seq"),
        "block-key keeps the number: {out}"
    );
    t.broker.wait_count(304, Duration::from_secs(30)).await;
    relay.stop().await;
    let seqs: Vec<i64> = t
        .key_p
        .iter()
        .map(|id| t.arrived(id).unwrap().seq().unwrap())
        .collect();
    assert_eq!(seqs, vec![1, 2, 3], "in order, gapless");
    let mut all = t.key_p.clone();
    all.extend(&t.others);
    all.push(marker);
    let report = check(&all, &t.broker.received());
    report.assert_clean();
}
