//! The operator dashboard (`/`) in headless Chromium: the relay and its HTTP endpoint run
//! in this process, the page is driven as a person would (typing, real mouse clicks) over
//! the DevTools protocol, and what it shows is checked against the database and the broker.
//! Screenshots are kept under `target/tmp/` as artifacts.

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Secret;
use outbox_relay::http::{self, HttpState};
use outbox_relay::relay::Deps;
use outbox_relay::telemetry::Telemetry;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support::browser::Browser;
use crate::support::{Broker, InProcessRelay, TestDb, amqp_url, test_config, unique};

const TOKEN: &str = "dashboard-test-token";

/// The HTTP endpoint on 127.0.0.1:<free port>, stopped on drop.
struct Endpoint {
    url: String,
    stop: CancellationToken,
}

impl Endpoint {
    async fn start(state: HttpState) -> Endpoint {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let stop = CancellationToken::new();
        tokio::spawn(http::serve(listener, state, stop.clone()));
        Endpoint { url, stop }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn artifact(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// A JavaScript expression: the parked row of this event on the page, if shown.
fn parked_row(event_id: Uuid) -> String {
    format!("document.querySelector('#parked tr[data-event-id=\"{event_id}\"]')")
}

/// (parked, dispatched) of the row in the database.
async fn row_state(client: &tokio_postgres::Client, event_id: Uuid) -> (bool, bool) {
    let row = client
        .query_one(
            "SELECT parked_at IS NOT NULL, dispatched_at IS NOT NULL FROM outbox_events WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// An unroutable row is parked (max attempts 1); the page shows it with its reason. A wrong
/// token is refused and the page says so; with the right token, once the routing key is
/// bound, the re-drive button puts it back, the relay delivers it, and the page shows the
/// backlog and the parked list empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_row_is_redriven_from_the_page() {
    let db = TestDb::new().await;
    let broker = Broker::new("order.#").await;
    let mut config = test_config(&broker);
    config.max_attempts = NonZeroU32::new(1).unwrap();
    // One Telemetry for the relay and the endpoint, as `main` wires them.
    let telemetry = Telemetry::default();
    let pool = db.pool();
    let deps = Deps {
        pool: pool.clone(),
        db: db.target.clone(),
        schema: db.schema.clone(),
        amqp: AmqpTarget::parse(&amqp_url()).unwrap(),
        telemetry: telemetry.clone(),
    };
    let relay_id = unique("dash-relay");
    let relay = InProcessRelay::start_with(deps, config, &relay_id);
    let endpoint = Endpoint::start(HttpState::new(
        telemetry.clone(),
        &db.target,
        &db.schema,
        Some(Secret::new(TOKEN)),
    ))
    .await;

    let client = db.client().await;
    let event_id: Uuid = client
        .query_one(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('ghost', 'g1', 'haunted', '{\"n\": 1}') RETURNING event_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Routable rows flow meanwhile (throughput, the relay's published count).
    let routable = db.insert(&client, 20, 4).await;
    broker
        .wait_count(routable.len(), Duration::from_secs(30))
        .await;

    let browser = Browser::start().await;
    let page = browser.open(&endpoint.url).await;
    // With a token configured the API wants it for reading too: the page asks for it.
    page.wait_until(
        "the page asking for the token",
        "!document.getElementById('need-token').hidden
         && document.getElementById('token-form').checkVisibility()
         && document.getElementById('error').textContent.includes('401')",
        Duration::from_secs(15),
    )
    .await;
    page.type_into("#token", TOKEN).await;
    let row_text = page
        .wait_until(
            "the parked row on the page",
            &format!("{}?.textContent", parked_row(event_id)),
            Duration::from_secs(30),
        )
        .await;
    let row_text = row_text.as_str().unwrap();
    assert!(
        row_text.contains("unroutable") && row_text.contains("ghost.haunted"),
        "the row shows its reason: {row_text}"
    );
    page.wait_until(
        "the relay shown alive, with its published count",
        &format!(
            "[...document.querySelectorAll('#relays tr')].some(tr => tr.textContent.includes({}) && tr.children[3].textContent === 'yes' && tr.children[5].textContent === '20')",
            json!(relay_id)
        ),
        Duration::from_secs(15),
    )
    .await;
    // The routable rows were delivered; their marks may land a moment later.
    page.wait_until(
        "ready, nothing pending, 20 dispatched, one parked",
        "document.getElementById('ready').textContent === 'ready'
         && document.getElementById('pending').textContent === '0'
         && document.getElementById('dispatched-minute').textContent === '20'
         && document.getElementById('parked-count').textContent === '1'",
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        page.eval(
            "[document.getElementById('read-only').checkVisibility(),
              document.getElementById('token-form').checkVisibility()]"
        )
        .await,
        json!([false, true]),
        "a token is configured: not read-only, a token field"
    );
    // The charts have drawn the sampler's history.
    page.wait_until(
        "the backlog chart drawn",
        "document.querySelector('#chart-backlog polyline')?.getAttribute('points')",
        Duration::from_secs(10),
    )
    .await;

    // The filter narrows the list through /api/parked.
    page.type_into("#f-aggregate-type", "order").await;
    page.click("#filter button[type=submit]").await;
    page.wait_until(
        "the list filtered empty",
        &format!(
            "!{} && !document.getElementById('parked-empty').hidden",
            parked_row(event_id)
        ),
        Duration::from_secs(10),
    )
    .await;
    page.type_into("#f-aggregate-type", "ghost").await;
    page.type_into("#f-event-type", "haunted").await;
    page.click("#filter button[type=submit]").await;
    page.wait_until(
        "the row back under a matching filter",
        &parked_row(event_id),
        Duration::from_secs(10),
    )
    .await;

    let shot = artifact("dashboard.png");
    page.screenshot(&shot).await;
    println!(
        "dashboard screenshot (parked row shown): {}",
        shot.display()
    );

    // A wrong token: refused, and the page says so; the row stays parked. A new token
    // refreshes the page when the field loses focus, and the refusal notice above the table
    // moves it: let that refresh land before the click, or the click can miss the button.
    let button = format!("#parked tr[data-event-id=\"{event_id}\"] button[data-redrive]");
    page.type_into("#token", "not-the-token").await;
    page.eval("document.getElementById('token').blur()").await;
    page.wait_until(
        "the refresh with the wrong token refused",
        "document.getElementById('error').textContent.includes('401')",
        Duration::from_secs(10),
    )
    .await;
    page.click(&button).await;
    let refused = page
        .wait_until(
            "the refusal shown",
            "document.getElementById('message').dataset.kind === 'error' && document.getElementById('message').textContent",
            Duration::from_secs(10),
        )
        .await;
    assert!(
        refused.as_str().unwrap().contains("401"),
        "the page shows the status: {refused}"
    );
    assert_eq!(
        row_state(&client, event_id).await,
        (true, false),
        "a refused re-drive leaves the row parked"
    );

    // Make it routable, then re-drive with the right token.
    broker.bind("ghost.#").await;
    page.type_into("#token", TOKEN).await;
    page.eval("document.getElementById('token').blur()").await;
    page.wait_until(
        "the refresh with the right token through",
        "document.getElementById('error').textContent === ''",
        Duration::from_secs(10),
    )
    .await;
    page.click(&button).await;
    page.wait_until(
        "the backlog and the parked list at zero",
        &format!(
            "document.getElementById('pending').textContent === '0'
             && document.getElementById('parked-count').textContent === '0'
             && !{}
             && document.getElementById('message').textContent.includes('re-drove 1 parked row')",
            parked_row(event_id)
        ),
        Duration::from_secs(30),
    )
    .await;
    broker
        .wait_count(routable.len() + 1, Duration::from_secs(30))
        .await;
    let last = broker.received().pop().unwrap();
    assert_eq!(last.message_id, event_id.to_string());
    assert_eq!(last.routing_key, "ghost.haunted");
    assert_eq!(
        row_state(&client, event_id).await,
        (false, true),
        "dispatched"
    );

    let after = artifact("dashboard-redriven.png");
    page.screenshot(&after).await;
    println!("dashboard screenshot (after re-drive): {}", after.display());
    assert_eq!(
        browser.problems(),
        Vec::<String>::new(),
        "the page logged no errors"
    );
    browser.close().await;
    drop(endpoint);
    relay.stop().await;
}

/// Without a token the page says it is read-only and offers no re-drive button, and the
/// API refuses (403). A database the endpoint cannot reach shows as an error, not as stale
/// numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_page_is_read_only_and_errors_show() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // Parked as the relay would leave it; no relay runs here, so the page is not ready.
    let event_id: Uuid = client
        .query_one(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('ghost', 'g2', 'haunted', '{}') RETURNING event_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    client
        .execute(
            "UPDATE outbox_events SET parked_at = now(), attempts = 1, last_error = 'too large: test'
              WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .unwrap();
    // Pending, returned three times so far (as a relay would have recorded it).
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, attempts, last_error)
             VALUES ('ghost', 'g3', 'haunted', '{}', 3,
                     'unroutable: exchange ''outbox.events'' has no queue bound for routing key ''ghost.haunted''')",
            &[],
        )
        .await
        .unwrap();
    let endpoint = Endpoint::start(HttpState::new(
        Telemetry::default(),
        &db.target,
        &db.schema,
        None,
    ))
    .await;

    let browser = Browser::start().await;
    let page = browser.open(&endpoint.url).await;
    page.wait_until(
        "the parked row on the page",
        &parked_row(event_id),
        Duration::from_secs(15),
    )
    .await;
    let waiting = page
        .wait_until(
            "why the pending row waits",
            "document.getElementById('waiting').checkVisibility()
             && document.getElementById('held-returned').textContent === '1'
             && document.getElementById('waiting-reasons').textContent",
            Duration::from_secs(15),
        )
        .await;
    assert!(
        waiting
            .as_str()
            .unwrap()
            .contains("no queue bound for routing key 'ghost.haunted'"),
        "{waiting}"
    );
    assert_eq!(
        page.eval(
            "[document.getElementById('read-only').checkVisibility(),
              document.getElementById('token-form').checkVisibility(),
              [...document.querySelectorAll('button[data-redrive]')].map(b => b.checkVisibility() || !b.disabled)]"
        )
        .await,
        json!([true, false, [false]]),
        "read-only notice shown, token field and buttons hidden and disabled"
    );
    assert_eq!(
        page.eval("document.getElementById('ready').dataset.ready")
            .await,
        json!("false")
    );
    let shot = artifact("dashboard-read-only.png");
    page.screenshot(&shot).await;
    println!("dashboard screenshot (read-only): {}", shot.display());
    let status = page
        .eval(
            "fetch('/api/redrive', { method: 'POST', headers: { 'Content-Type': 'application/json',
               'Authorization': 'Bearer anything' }, body: '{\"ids\": [1]}' }).then(r => r.status)",
        )
        .await;
    assert_eq!(status, json!(403));
    assert_eq!(row_state(&client, event_id).await, (true, false));

    // An endpoint whose database does not exist: the API answers 503 and the page shows it.
    let missing = db.target.with_dbname(&unique("it_missing"));
    let broken = Endpoint::start(HttpState::new(
        Telemetry::default(),
        &missing,
        &db.schema,
        None,
    ))
    .await;
    let page = browser.open(&broken.url).await;
    let error = page
        .wait_until(
            "the error shown",
            "document.getElementById('error').textContent",
            Duration::from_secs(20),
        )
        .await;
    assert!(error.as_str().unwrap().contains("503"), "{error}");
    assert!(
        !error.as_str().unwrap().contains("does not exist"),
        "no database text for a caller without the token: {error}"
    );
    browser.close().await;
}
