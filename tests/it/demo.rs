//! `outbox-relay demo` as a user runs it: a process against the local services, with its
//! own database, exchange and queue names.

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;

use crate::support::process::run_to_end;
use crate::support::{admin_url, amqp_url, rabbitmqctl, unique};

/// Deletes what the demo's consumer declared: its queue, retry queues, dead-letter
/// exchange and queue, and the demo exchange.
async fn delete_topology(exchange: &str, queue: &str) {
    let listing = rabbitmqctl(&["list_queues", "-q", "--no-table-headers", "name"]).await;
    let conn = AmqpTarget::parse(&amqp_url())
        .unwrap()
        .connect("outbox-it-demo-cleanup")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    for name in listing.lines().map(str::trim) {
        if name == queue || name.starts_with(&format!("{queue}.")) {
            ch.queue_delete(name.into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
    }
    for name in [exchange.to_owned(), format!("{queue}.dlx")] {
        ch.exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
    }
}

async fn admin() -> tokio_postgres::Client {
    DbTarget::parse(&admin_url())
        .unwrap()
        .connect(&Schema::default(), "outbox-it-demo")
        .await
        .unwrap()
}

/// The summary line on stdout.
fn summary(stdout: &str) -> &str {
    stdout
        .lines()
        .find(|l| l.starts_with("demo summary:"))
        .unwrap_or_else(|| panic!("no summary line in {stdout:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_produces_relays_consumes_and_reports_no_loss() {
    let database = unique("it");
    let exchange = unique("it.demo").replace('_', ".");
    let queue = format!("{exchange}.q");
    let amqp = amqp_url();
    let args = |events: &'static str| {
        vec![
            "demo".to_owned(),
            "--database-url".into(),
            admin_url(),
            "--amqp-url".into(),
            amqp.clone(),
            "--database-name".into(),
            database.clone(),
            "--exchange".into(),
            exchange.clone(),
            "--queue".into(),
            queue.clone(),
            "--rate".into(),
            "100".into(),
            "--events".into(),
            events.into(),
            "--keys".into(),
            "10".into(),
        ]
    };

    let first = args("150");
    let first: Vec<&str> = first.iter().map(String::as_str).collect();
    let (code, out, err) = run_to_end(&first, &[]).await;
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    let line = summary(&out);
    for expected in [
        "produced 150,",
        "published 150,",
        "consumed 150,",
        "lost 0,",
        "duplicates 0,",
        "stray 0;",
    ] {
        assert!(line.contains(expected), "{expected:?} missing in {line:?}");
    }
    assert!(
        line.contains("latency p50 ") && !line.contains("p50 -"),
        "{line}"
    );
    // Not a terminal: one progress line a second (150 events at 100/s take 1.5 s).
    assert!(
        err.lines()
            .any(|l| l.starts_with("demo ") && l.contains("produced")),
        "no progress line in {err:?}"
    );

    // What the summary claims is what the demo database holds.
    let db = DbTarget::parse(&admin_url())
        .unwrap()
        .with_dbname(&database)
        .connect(&Schema::default(), "outbox-it-demo")
        .await
        .unwrap();
    let row = db
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE dispatched_at IS NULL),
                    (SELECT count(*) FROM outbox_inbox WHERE consumer = $1)
               FROM outbox_events",
            &[&queue],
        )
        .await
        .unwrap();
    // 150 events and the warm-up, every one dispatched and recorded in the inbox.
    assert_eq!(row.get::<_, i64>(0), 151);
    assert_eq!(row.get::<_, i64>(1), 0);
    assert_eq!(row.get::<_, i64>(2), 151);
    drop(db);

    // A second run drops the first run's database and starts afresh.
    let second = args("20");
    let second: Vec<&str> = second.iter().map(String::as_str).collect();
    let (code, out, err) = run_to_end(&second, &[]).await;
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    let line = summary(&out);
    assert!(
        line.contains("produced 20,") && line.contains("lost 0,"),
        "{line}"
    );

    delete_topology(&exchange, &queue).await;
    admin()
        .await
        .batch_execute(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .await
        .unwrap();
}

/// A database the demo did not create is never dropped: exit 2, and it is still there.
#[tokio::test]
async fn demo_refuses_to_drop_a_database_it_did_not_create() {
    let database = unique("it");
    let admin = admin().await;
    admin
        .batch_execute(&format!("CREATE DATABASE {database}"))
        .await
        .unwrap();
    let (code, _, err) = run_to_end(
        &[
            "demo",
            "--database-url",
            &admin_url(),
            "--database-name",
            &database,
            "--events",
            "1",
        ],
        &[],
    )
    .await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--database-name") && err.contains("was not created by outbox-relay demo"),
        "{err}"
    );
    let still_there = admin
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&database])
        .await
        .unwrap();
    assert!(still_there.is_some());
    admin
        .batch_execute(&format!("DROP DATABASE {database}"))
        .await
        .unwrap();
}

/// Bad arguments exit 2 with one line naming the flag; environment variables count too.
#[tokio::test]
async fn demo_bad_arguments_exit_2_naming_the_flag() {
    for (args, env, flag) in [
        (&["demo", "--rate", "0"][..], &[][..], "--rate"),
        (&["demo", "--rate", "1000000"], &[], "--rate"),
        (
            &["demo", "--events", "5", "--duration", "1s"],
            &[],
            "--events",
        ),
        (&["demo", "--duration", "soon"], &[], "--duration"),
        (
            &["demo", "--database-name", "Bad-Name"],
            &[],
            "--database-name",
        ),
        (
            &["demo", "--database-name", "postgres"],
            &[(
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/postgres",
            )],
            "--database-name",
        ),
        (&["demo"], &[("OUTBOX_DEMO_KEYS", "0")], "--keys"),
        (
            &["demo"],
            &[("OUTBOX_DEMO_HTTP_LISTEN", "nowhere")],
            "--http-listen",
        ),
    ] {
        let (code, out, err) = run_to_end(args, env).await;
        assert_eq!(code, 2, "{args:?} {env:?}: {out}{err}");
        assert_eq!(err.lines().count(), 1, "one line: {err}");
        assert!(
            err.contains(flag),
            "{args:?} {env:?} should name {flag}: {err}"
        );
    }
}
