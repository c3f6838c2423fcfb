//! `sql/roles.sql`: the relay, a producer and a consumer-kit user each run under their own
//! least-privilege role, and a producer cannot change, delete or read events.
//!
//! Roles are cluster-wide, so every test names its own (`outbox_it_<test>_<role>`) and
//! roles.sql creates them only when missing; each test applies it to its own database.
//! The template database is migrated as `postgres`, like an owner would; the roles get
//! passwords and connect with them.

use std::time::Duration;

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::db::DbTarget;
use outbox_kit::producer::{NewEvent, Outbox};
use outbox_relay::relay::Deps;
use serde_json::json;
use tokio_postgres::Client;

use crate::support::checker::check;
use crate::support::process::run_to_end;
use crate::support::{Broker, InProcessRelay, TestDb, amqp_url, test_config, wait_for};

const ROLES_SQL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/sql/roles.sql");
const PERMISSION_DENIED: &str = "42501";
/// Every test role's password (ignored where the server trusts 127.0.0.1).
const ROLE_PASSWORD: &str = "outbox-it-role";

/// The three role names one test uses.
struct Roles {
    relay: String,
    producer: String,
    consumer: String,
}

impl Roles {
    fn for_test(test: &str) -> Roles {
        Roles {
            relay: format!("outbox_it_{test}_relay"),
            producer: format!("outbox_it_{test}_producer"),
            consumer: format!("outbox_it_{test}_consumer"),
        }
    }
}

/// `psql <url> -v ... -f sql/roles.sql`, as an operator runs it; returns (status, stderr).
async fn psql_roles(url: &str, roles: &Roles) -> (i32, String) {
    let out = tokio::process::Command::new("psql")
        .arg(url)
        .args(["-X", "-v", "schema=public"])
        .arg("-v")
        .arg(format!("relay_role={}", roles.relay))
        .arg("-v")
        .arg(format!("producer_role={}", roles.producer))
        .arg("-v")
        .arg(format!("consumer_role={}", roles.consumer))
        // Passwords, so the tests also pass where only `postgres` is trusted on 127.0.0.1
        // (scripts/services.sh sets that up on a fresh install).
        .arg("-v")
        .arg(format!("relay_password={ROLE_PASSWORD}"))
        .arg("-v")
        .arg(format!("producer_password={ROLE_PASSWORD}"))
        .arg("-v")
        .arg(format!("consumer_password={ROLE_PASSWORD}"))
        .args(["-f", ROLES_SQL])
        .output()
        .await
        .expect("psql runs (postgresql-client)");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Applies roles.sql twice (it must be idempotent).
async fn apply_roles(db: &TestDb, roles: &Roles) {
    for round in 0..2 {
        let (mut code, mut stderr) = psql_roles(&db.url(), roles).await;
        if code != 0 && stderr.contains("already exists") {
            // Another test run created the same role between our check and our CREATE.
            (code, stderr) = psql_roles(&db.url(), roles).await;
        }
        assert_eq!(code, 0, "roles.sql (round {round}) failed: {stderr}");
    }
}

/// The test database's URL with another user.
fn url_as(db: &TestDb, role: &str) -> String {
    let url = db.url();
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let host = rest.split_once('@').map_or(rest, |(_, h)| h);
    format!("{scheme}://{role}:{ROLE_PASSWORD}@{host}")
}

fn target_as(db: &TestDb, role: &str) -> DbTarget {
    DbTarget::parse(&url_as(db, role)).unwrap()
}

async fn connect_as(db: &TestDb, role: &str) -> Client {
    target_as(db, role)
        .connect(&db.schema, "outbox-it-role")
        .await
        .unwrap_or_else(|e| panic!("connect as {role}: {e}"))
}

/// Runs `sql` and returns its SQLSTATE, or "ok".
async fn sqlstate(client: &Client, sql: &str) -> String {
    match client.batch_execute(sql).await {
        Ok(()) => "ok".into(),
        Err(e) => e
            .code()
            .map(|c| c.code().to_owned())
            .unwrap_or_else(|| format!("no sqlstate: {e}")),
    }
}

/// Events written by a producer role in three ways (plain INSERT, outbox_enqueue, the Rust
/// API) reach the exchange through a relay running as the relay role; a parked row is
/// re-driven by `outbox-relay redrive` as the relay role; `status` and retention work too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_and_producer_run_under_their_roles() {
    let db = TestDb::new().await;
    let roles = Roles::for_test("e2e");
    apply_roles(&db, &roles).await;
    let broker = Broker::new("order.#").await;

    let relay_target = target_as(&db, &roles.relay);
    let relay_pool = relay_target.pool(&db.schema, "outbox-relay", 8);
    let deps = Deps {
        pool: relay_pool.clone(),
        db: relay_target.clone(),
        schema: db.schema.clone(),
        amqp: AmqpTarget::parse(&amqp_url()).unwrap(),
        telemetry: Default::default(),
    };
    let mut config = test_config(&broker);
    config.max_attempts = std::num::NonZeroU32::new(2).unwrap();
    let relay = InProcessRelay::start_with(deps, config, "roles-e2e");

    let producer = connect_as(&db, &roles.producer).await;
    // Plain INSERT without RETURNING: INSERT on the producer columns is all it takes.
    producer
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'plain-' || (g % 5), 'created', jsonb_build_object('n', g)
               FROM generate_series(1, 50) AS g",
        )
        .await
        .expect("plain insert as the producer role");
    let mut committed: Vec<uuid::Uuid> = Vec::new();
    // INSERT ... RETURNING event_id (needs SELECT on event_id only).
    let rows = producer
        .query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'ret-' || (g % 5), 'created', jsonb_build_object('n', g)
               FROM generate_series(1, 50) AS g RETURNING event_id",
            &[],
        )
        .await
        .expect("insert returning event_id as the producer role");
    committed.extend(rows.iter().map(|r| r.get::<_, uuid::Uuid>(0)));
    for n in 0..20 {
        let row = producer
            .query_one(
                "SELECT outbox_enqueue('order', 'fn-' || ($1::int % 3), 'paid', jsonb_build_object('n', $1::int))",
                &[&n],
            )
            .await
            .expect("outbox_enqueue as the producer role");
        committed.push(row.get(0));
    }
    let outbox = Outbox::new("public").unwrap();
    let events: Vec<NewEvent<'_>> = (0..30)
        .map(|n| NewEvent::new("order", "rust", "shipped", json!({ "n": n })))
        .collect();
    committed.extend(
        outbox
            .enqueue_many(&producer, &events)
            .await
            .expect("Rust producer API as the producer role"),
    );
    // One row nobody is bound for: returned, retried, parked after 2 attempts.
    let parked_event: uuid::Uuid = producer
        .query_one(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, routing_key)
             VALUES ('order', 'lonely', 'created', '{}', 'unbound.created') RETURNING event_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    let admin = db.client().await;
    let plain: Vec<uuid::Uuid> = admin
        .query(
            "SELECT event_id FROM outbox_events WHERE aggregate_id LIKE 'plain-%'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(plain.len(), 50);
    committed.extend(plain);
    assert_eq!(committed.len(), 150);

    broker.wait_all(&committed, Duration::from_secs(60)).await;
    let parked_id: i64 = wait_for("the unroutable row parked", Duration::from_secs(30), || {
        let admin = &admin;
        async move {
            admin
                .query_opt(
                    "SELECT id FROM outbox_events WHERE event_id = $1 AND parked_at IS NOT NULL",
                    &[&parked_event],
                )
                .await
                .unwrap()
                .map(|r| r.get(0))
        }
    })
    .await;

    // The operator commands as the relay role: status, then the re-drive.
    let relay_url = url_as(&db, &roles.relay);
    let (code, out, err) = run_to_end(&["status", "--database-url", &relay_url], &[]).await;
    assert_eq!(code, 0, "status as the relay role: {out}{err}");
    assert!(out.contains("parked"), "{out}");
    broker.bind("unbound.#").await;
    let (code, out, err) = run_to_end(
        &[
            "redrive",
            "--id",
            &parked_id.to_string(),
            "--database-url",
            &relay_url,
        ],
        &[],
    )
    .await;
    assert_eq!(code, 0, "redrive as the relay role: {out}{err}");
    committed.push(parked_event);
    broker.wait_all(&committed, Duration::from_secs(30)).await;
    wait_for("every row dispatched", Duration::from_secs(30), || async {
        (db.count(&admin, "dispatched_at IS NULL").await == 0).then_some(())
    })
    .await;
    relay.stop().await;

    let report = check(&committed, &broker.received());
    report.assert_clean();
    assert_eq!(report.committed, 151);

    // --retention's sweep as the relay role (DELETE, FOR UPDATE SKIP LOCKED).
    tokio::time::sleep(Duration::from_millis(20)).await;
    let deleted = outbox_relay::relay::retention::sweep(
        &relay_pool,
        Duration::from_millis(1),
        &Default::default(),
    )
    .await
    .expect("retention sweep as the relay role");
    assert_eq!(deleted, 151);

    // A claim that finds more candidates than the statistics say are pending analyzes
    // the table, which the relay role does not own (sql/0007, "Statistics").
    let relay_client = connect_as(&db, &roles.relay).await;
    // (No autovacuum meanwhile: its ANALYZE would make this one skip the table.)
    admin
        .batch_execute(
            "ALTER TABLE outbox_events SET (autovacuum_enabled = off);
             SELECT pg_stat_reset_single_table_counters('outbox_events'::regclass);",
        )
        .await
        .unwrap();
    let analyzed: bool = relay_client
        .query_one("SELECT outbox_refresh_statistics(1000000)", &[])
        .await
        .expect("outbox_refresh_statistics as the relay role")
        .get(0);
    assert!(analyzed);
    let last: Option<std::time::SystemTime> = admin
        .query_one(
            "SELECT last_analyze FROM pg_stat_user_tables WHERE relid = 'outbox_events'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(last.is_some(), "ANALYZE ran as the owner");
}

/// What each role must not do ends in SQLSTATE 42501 (permission denied).
#[tokio::test]
async fn roles_are_refused_what_they_do_not_need() {
    let db = TestDb::new().await;
    let roles = Roles::for_test("deny");
    apply_roles(&db, &roles).await;
    let admin = db.client().await;
    db.insert(&admin, 3, 3).await;

    let producer = connect_as(&db, &roles.producer).await;
    for sql in [
        "UPDATE outbox_events SET payload = '{\"evil\": true}'",
        "UPDATE outbox_events SET dispatched_at = now()",
        "DELETE FROM outbox_events",
        "SELECT payload FROM outbox_events",
        "SELECT * FROM outbox_events",
        "SELECT count(*) FROM outbox_events WHERE aggregate_id = 'k1'",
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, dispatched_at)
         VALUES ('order', 'x', 'created', '{}', now())",
        "SELECT * FROM outbox_redrive(ARRAY[1::bigint], false)",
        "SELECT outbox_leave('someone')",
        "UPDATE outbox_relays SET wants_wakeup = false",
        "SELECT * FROM outbox_inbox",
    ] {
        assert_eq!(
            sqlstate(&producer, sql).await,
            PERMISSION_DENIED,
            "the producer role may not: {sql}"
        );
    }
    // What it may do, for contrast: the test above must not pass for a role that can't connect.
    assert_eq!(
        sqlstate(
            &producer,
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'x', 'created', '{}')"
        )
        .await,
        "ok"
    );

    let relay = connect_as(&db, &roles.relay).await;
    for sql in [
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', 'x', 'created', '{}')",
        "UPDATE outbox_events SET payload = '{}'",
        "UPDATE outbox_events SET routing_key = 'elsewhere'",
        "SELECT outbox_enqueue('order', 'x', 'created', '{}')",
        "DELETE FROM outbox_partitions",
        "SELECT * FROM outbox_effects",
        "SELECT * FROM outbox_schema_migrations",
        "CREATE TABLE sneaky (x int)",
    ] {
        assert_eq!(
            sqlstate(&relay, sql).await,
            PERMISSION_DENIED,
            "the relay role may not: {sql}"
        );
    }

    let consumer = connect_as(&db, &roles.consumer).await;
    for sql in [
        "SELECT * FROM outbox_events",
        "SELECT outbox_enqueue('order', 'x', 'created', '{}')",
        "SELECT * FROM outbox_claim('me', 0, 10, 10, false, 1000, 1000)",
    ] {
        assert_eq!(
            sqlstate(&consumer, sql).await,
            PERMISSION_DENIED,
            "the consumer role may not: {sql}"
        );
    }

    // `run` without --no-migrate as the relay role: migrations are the owner's job; the
    // relay says so and exits 1 (not a retry loop).
    let relay_url = url_as(&db, &roles.relay);
    let (code, _, err) = run_to_end(
        &[
            "run",
            "--database-url",
            &relay_url,
            "--http-listen",
            "off",
            "--exchange",
            "outbox.it.never",
        ],
        &[],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("migration failed") && err.contains("permission denied"),
        "{err}"
    );
}

/// The consumer kit's functions, called as the consumer role: inbox, ordered groups (join,
/// heartbeat, record, dead with block, hold, release, drain), gaps,
/// effects (claim, complete, cancel), budgets, the reconciler's queries and pruning.
#[tokio::test]
async fn consumer_role_runs_the_kit() {
    let db = TestDb::new().await;
    let roles = Roles::for_test("kit");
    apply_roles(&db, &roles).await;
    let c = connect_as(&db, &roles.consumer).await;
    let steps = [
        "SELECT outbox_budget_set('acme', 'mail', 5)",
        "SELECT * FROM outbox_inbox_record('billing', gen_random_uuid(), 'order', '1', 1)",
        "SELECT * FROM outbox_inbox_record('billing', gen_random_uuid(), 'order', '1', 3)",
        "SELECT outbox_inbox_gap('billing', gen_random_uuid(), 'order', '1', 2, 3, 'skipped')",
        "SELECT outbox_inbox_dead('billing', gen_random_uuid(), 'order', '2', 5, 'bad', true)",
        "SELECT outbox_group_join('orders', 4)",
        "SELECT * FROM outbox_group_beat('orders', 'm1', 3000)",
        "SELECT * FROM outbox_group_record('orders', 1, gen_random_uuid(), 'order', '9', 1, 'created', 'order.created', '{}', '\\x7b7d')",
        "SELECT outbox_group_dead('orders', gen_random_uuid(), 'order', '9', 2, 'bad', true)",
        "SELECT * FROM outbox_group_record('orders', 1, gen_random_uuid(), 'order', '9', 3, 'created', 'order.created', '{}', '\\x7b7d')",
        "SELECT outbox_consumer_release('orders', 'order', '9')",
        "SELECT * FROM outbox_group_releasable('orders', ARRAY[1])",
        "SELECT * FROM outbox_group_take_held('orders', 'order', '9')",
        "SELECT outbox_group_leave('orders', 'm1')",
        "SELECT outbox_effect_enqueue('receipt:1', 'mail', '{}', 'acme', 'mail', 1, true)",
        "SELECT * FROM outbox_effect_claim('receipt:1', 'w1', 30, 5, 5)",
        "SELECT outbox_effect_complete((SELECT id FROM outbox_effects WHERE effect_key = 'receipt:1'), 'w1', 'ext-1')",
        "SELECT outbox_effect_enqueue('receipt:2', 'mail', '{}', NULL, NULL, NULL, false)",
        "SELECT * FROM outbox_effect_cancel('receipt:2')",
        "SELECT * FROM outbox_effect_stuck(60, 10)",
        "SELECT * FROM outbox_consumer_prune(now() + interval '1 day', 100)",
    ];
    for sql in steps {
        assert_eq!(
            sqlstate(&c, sql).await,
            "ok",
            "the consumer role must be able to: {sql}"
        );
    }
    let left: i64 = c
        .query_one("SELECT count(*) FROM outbox_effects", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "prune deleted the finished effects");
}

/// Every outbox table and function the migrations create is named in roles.sql, so a new
/// migration cannot add one that no role (or, for functions, PUBLIC) may use unnoticed.
#[tokio::test]
async fn roles_sql_names_every_outbox_table_and_function() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    let sql = std::fs::read_to_string(ROLES_SQL).unwrap();
    // Helpers that read no table stay executable by PUBLIC, and the ledger of
    // `outbox-relay migrate` (migrations, function files) is the owner's alone.
    let public = [
        "outbox_headers_allowed",
        "outbox_partition_of",
        "outbox_claim_lock_key",
        "outbox_uuid_v7",
        "outbox_utf8_valid",
        "outbox_contract_version",
        "outbox_schema_migrations",
        "outbox_schema_functions",
    ];
    let names = admin
        .query(
            "SELECT relname::text FROM pg_class c WHERE relnamespace = 'public'::regnamespace
                AND relkind IN ('r', 'p', 'v', 'S') AND relname LIKE 'outbox\\_%'
                -- an identity column's sequence needs no grant of its own
                AND NOT EXISTS (SELECT 1 FROM pg_depend d
                                 WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                                   AND d.deptype = 'i')
             UNION
             SELECT proname::text FROM pg_proc WHERE pronamespace = 'public'::regnamespace
                AND proname LIKE 'outbox\\_%'
                -- triggers fire whatever the writing role may EXECUTE: no grant to make
                AND prorettype <> 'trigger'::regtype",
            &[],
        )
        .await
        .unwrap();
    assert!(names.len() > 30, "expected the migrated objects");
    let missing: Vec<String> = names
        .iter()
        .map(|r| r.get::<_, String>(0))
        .filter(|n| {
            let quoted = format!("'{n}'");
            let qualified = format!(".{n} ");
            let listed = format!(".{n},");
            let ended = format!(".{n}\n");
            !public.contains(&n.as_str())
                && !sql.contains(&quoted)
                && !sql.contains(&qualified)
                && !sql.contains(&listed)
                && !sql.contains(&ended)
        })
        .collect();
    assert!(
        missing.is_empty(),
        "roles.sql grants nothing on {missing:?}: add them to the role that needs them"
    );
    for helper in public {
        assert!(
            sql.contains(helper),
            "roles.sql explains why {helper} is left alone"
        );
    }
}

/// The producer role enqueues idempotently (SQL and the Rust API), reads the contract
/// version and may call the documented `outbox_effect_claim` forms only as the consumer.
#[tokio::test]
async fn producer_role_enqueues_idempotently() {
    let db = TestDb::new().await;
    let roles = Roles::for_test("idem");
    apply_roles(&db, &roles).await;
    let producer = connect_as(&db, &roles.producer).await;
    let deadline = Duration::from_secs(30);
    let enqueue =
        "SELECT outbox_enqueue('order', 'x', 'created', '{}', idempotency_key => 'req-1')";
    let first: uuid::Uuid = tokio::time::timeout(deadline, producer.query_one(enqueue, &[]))
        .await
        .unwrap()
        .expect("outbox_enqueue with a key as the producer role")
        .get(0);
    let again: uuid::Uuid = tokio::time::timeout(deadline, producer.query_one(enqueue, &[]))
        .await
        .unwrap()
        .expect("a taken key as the producer role")
        .get(0);
    assert_eq!(first, again);
    let outbox = Outbox::new("public").unwrap();
    let event = NewEvent::new("order", "x", "created", json!({})).with_idempotency_key("req-1");
    let rust = tokio::time::timeout(deadline, outbox.enqueue(&producer, &event))
        .await
        .unwrap()
        .expect("the Rust API with a key as the producer role");
    assert_eq!(rust, first);
    let version: i32 = tokio::time::timeout(
        deadline,
        producer.query_one("SELECT outbox_contract_version()", &[]),
    )
    .await
    .unwrap()
    .expect("any role reads the contract version")
    .get(0);
    assert!(version >= 17);
    let consumer = connect_as(&db, &roles.consumer).await;
    assert_eq!(
        sqlstate(
            &consumer,
            "SELECT * FROM outbox_effect_claim('none', 'w', 60)"
        )
        .await,
        "ok",
        "the consumer role may call the three-argument claim"
    );
    assert_eq!(
        sqlstate(
            &producer,
            "SELECT * FROM outbox_effect_claim('none', 'w', 60)"
        )
        .await,
        PERMISSION_DENIED
    );
}

/// Before the migrations, roles.sql stops with a message saying what to do.
#[tokio::test]
async fn roles_sql_refuses_an_unmigrated_database() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin
        .batch_execute("CREATE SCHEMA empty")
        .await
        .expect("create schema");
    let out = tokio::process::Command::new("psql")
        .arg(db.url())
        .args(["-X", "-v", "schema=empty", "-f", ROLES_SQL])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("no outbox tables") && stderr.contains("outbox-relay migrate"),
        "{stderr}"
    );
}

/// `GET path` on 127.0.0.1:port; returns (status, body).
async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut text))
        .await
        .ok()?
        .ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

/// The documented command, `outbox-relay run --no-migrate` as the relay role, with the HTTP
/// endpoint: ready, its metrics sampled from the database, events published, a clean exit.
#[tokio::test]
async fn relay_process_runs_under_the_relay_role() {
    let db = TestDb::new().await;
    let roles = Roles::for_test("process");
    apply_roles(&db, &roles).await;
    let broker = Broker::new("#").await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut relay = crate::support::process::RelayProcess::start(
        &crate::support::unique("roles-process"),
        &[
            "--no-migrate".into(),
            "--database-url".into(),
            url_as(&db, &roles.relay),
            "--amqp-url".into(),
            amqp_url(),
            "--exchange".into(),
            broker.exchange.clone(),
            "--http-listen".into(),
            format!("127.0.0.1:{port}"),
            "--poll-interval".into(),
            "200ms".into(),
        ],
    );
    let producer = connect_as(&db, &roles.producer).await;
    producer
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'p' || g, 'created', '{}' FROM generate_series(1, 7) AS g",
        )
        .await
        .unwrap();
    broker.wait_count(7, Duration::from_secs(30)).await;
    wait_for("ready", Duration::from_secs(30), || async {
        matches!(http_get(port, "/readyz").await, Some((200, _))).then_some(())
    })
    .await;
    // The endpoint samples the outbox as the relay role: all 7 dispatched, none pending.
    wait_for("metrics sampled", Duration::from_secs(30), || async {
        let (_, body) = http_get(port, "/metrics").await?;
        let dispatched = body
            .lines()
            .any(|l| l.starts_with("outbox_rows_dispatched_total 7"));
        let pending = body.lines().any(|l| l == "outbox_pending_rows 0");
        (dispatched && pending).then_some(())
    })
    .await;
    relay.signal("TERM");
    assert_eq!(
        relay.wait(Duration::from_secs(30)).await,
        Some(0),
        "{}",
        relay.log_text()
    );
    assert!(
        !relay.log_text().contains("permission denied"),
        "{}",
        relay.log_text()
    );
}

/// The role table in docs/operating.md says what roles.sql grants, both ways: every table,
/// sequence and function roles.sql grants a role is named in that role's "may" cell (by
/// name or by a `prefix_*` pattern), and every object the cell names is granted to it.
#[test]
fn the_role_table_in_operating_md_matches_roles_sql() {
    use std::collections::{BTreeMap, BTreeSet};
    let sql = std::fs::read_to_string(ROLES_SQL).unwrap();
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operating.md")).unwrap();
    // What roles.sql grants, per role variable (relay, producer, consumer).
    let mut granted: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    let statements: Vec<String> = sql
        .split(';')
        .map(|s| {
            s.lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    for st in &statements {
        let st = st.trim();
        let Some((_, rest)) = st.split_once(" ON ") else {
            continue;
        };
        if !st.starts_with("GRANT ") || !rest.contains(":\"schema\".") {
            continue;
        }
        let (object, role) = rest.split_once(" TO ").expect("GRANT ... TO");
        let object = object
            .rsplit(":\"schema\".")
            .next()
            .unwrap()
            .trim()
            .to_owned();
        for role in role.split(',') {
            let role = role.trim().trim_matches(':').trim_matches('"');
            let role = role.strip_suffix("_role").expect("a role variable");
            granted.entry(role).or_default().insert(object.clone());
        }
    }
    for line in sql.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("('") {
            let (function, role) = rest.split_once("', ").unwrap();
            if let Some(role) = role.strip_prefix(":'") {
                let role = role.split('_').next().unwrap();
                granted.entry(role).or_default().insert(function.to_owned());
            }
        }
    }
    let known: BTreeSet<String> = granted.values().flatten().cloned().collect();
    assert!(known.len() > 40, "expected roles.sql's grants: {granted:?}");

    for (role, objects) in &granted {
        let row = doc
            .lines()
            .find(|l| l.starts_with(&format!("| `outbox_{role}` |")))
            .unwrap_or_else(|| panic!("docs/operating.md has no row for outbox_{role}"));
        let may = row.split('|').nth(2).unwrap();
        let named: Vec<&str> = may
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|t| t.starts_with("outbox_"))
            .collect();
        let covered = |object: &str| {
            named.iter().any(|t| match t.strip_suffix('*') {
                Some(prefix) => object.starts_with(prefix),
                None => *t == object,
            })
        };
        let unnamed: Vec<&String> = objects.iter().filter(|o| !covered(o)).collect();
        assert!(
            unnamed.is_empty(),
            "roles.sql grants outbox_{role} {unnamed:?}, which its row in docs/operating.md does not name"
        );
        let not_granted: Vec<&&str> = named
            .iter()
            .filter(|t| !t.ends_with('*') && known.contains(**t) && !objects.contains(**t))
            .collect();
        assert!(
            not_granted.is_empty(),
            "docs/operating.md says outbox_{role} may use {not_granted:?}, which roles.sql does not grant it"
        );
    }
}
