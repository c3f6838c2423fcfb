//! A fake messaging provider on plain HTTP, with the faults real ones have.
//!
//! - `POST /messages` `{"key", "to", "text"}` → `200 {"id"}` once the message is accepted;
//!   `422 {"error": "invalid address"}` when `to` ends with `@invalid`; `503` (not accepted)
//!   with probability `p_unavailable`; with `p_slow_accepted` the message is accepted but the
//!   answer comes after `slow` (longer than any sane client timeout: the answer is lost);
//!   with `p_slow_dropped` nothing is accepted and the answer is just as late.
//! - `GET /messages?key=K` → `200 {"id"}` if a message with that key was accepted, else 404
//!   (the lookup the consumer kit uses after an unknown outcome).
//! - `DELETE /messages/{id}` → 204 (withdrawn), 404, or 503 while `fail_deletes` is on.
//!
//! It counts every acceptance per key, so a test can tell whether anything was sent twice.

// The tests use parts of the provider that the demo does not.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{delete, post};
use serde_json::{Value, json};

/// How often each fault happens (0.0 to 1.0), and how late a slow answer comes.
#[derive(Clone, Debug)]
pub struct Faults {
    pub p_unavailable: f64,
    pub p_slow_accepted: f64,
    pub p_slow_dropped: f64,
    pub slow: Duration,
    pub seed: u64,
}

impl Faults {
    pub fn none() -> Faults {
        Faults {
            p_unavailable: 0.0,
            p_slow_accepted: 0.0,
            p_slow_dropped: 0.0,
            slow: Duration::from_secs(2),
            seed: 1,
        }
    }
}

/// One accepted message.
#[derive(Clone, Debug)]
pub struct Accepted {
    pub id: String,
    pub key: String,
    pub to: String,
    pub deleted: bool,
}

/// What the provider holds; shared with whoever started it.
#[derive(Default)]
pub struct Book {
    pub messages: Mutex<Vec<Accepted>>,
    pub fail_deletes: AtomicBool,
    pub requests: AtomicU64,
}

impl Book {
    /// How many times a message with `key` was accepted.
    pub fn accepted(&self, key: &str) -> usize {
        self.messages
            .lock()
            .unwrap()
            .iter()
            .filter(|m| m.key == key)
            .count()
    }

    /// Accepted and not withdrawn.
    pub fn live(&self, key: &str) -> bool {
        self.messages
            .lock()
            .unwrap()
            .iter()
            .any(|m| m.key == key && !m.deleted)
    }

    pub fn per_key(&self) -> HashMap<String, usize> {
        let mut n = HashMap::new();
        for m in self.messages.lock().unwrap().iter() {
            *n.entry(m.key.clone()).or_default() += 1;
        }
        n
    }
}

struct App {
    book: Arc<Book>,
    faults: Faults,
    rng: Mutex<u64>,
    next_id: AtomicU64,
}

impl App {
    /// xorshift64*: reproducible faults for a given seed, without a dependency.
    fn roll(&self) -> f64 {
        let mut s = self.rng.lock().unwrap();
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        let r = s.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (r >> 11) as f64 / (1u64 << 53) as f64
    }

    fn accept(&self, key: &str, to: &str) -> String {
        let id = format!("msg-{}", self.next_id.fetch_add(1, Ordering::Relaxed));
        self.book.messages.lock().unwrap().push(Accepted {
            id: id.clone(),
            key: key.to_owned(),
            to: to.to_owned(),
            deleted: false,
        });
        id
    }
}

/// A running provider: its address and its book.
pub struct Provider {
    pub addr: SocketAddr,
    pub book: Arc<Book>,
    task: tokio::task::JoinHandle<()>,
}

impl Provider {
    /// Listens on 127.0.0.1 on a free port.
    pub async fn start(faults: Faults) -> std::io::Result<Provider> {
        let book = Arc::new(Book::default());
        let app = Arc::new(App {
            book: book.clone(),
            rng: Mutex::new(faults.seed.max(1)),
            faults,
            next_id: AtomicU64::new(1),
        });
        let router = Router::new()
            .route("/messages", post(send).get(lookup))
            .route("/messages/{id}", delete(remove))
            .with_state(app);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Ok(Provider { addr, book, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn send(State(app): State<Arc<App>>, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    app.book.requests.fetch_add(1, Ordering::Relaxed);
    let key = body["key"].as_str().unwrap_or_default().to_owned();
    let to = body["to"].as_str().unwrap_or_default().to_owned();
    if key.is_empty() || to.ends_with("@invalid") {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"error": "invalid address"})),
        );
    }
    let roll = app.roll();
    let f = &app.faults;
    if roll < f.p_unavailable {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "try later"})),
        );
    }
    if roll < f.p_unavailable + f.p_slow_accepted {
        let id = app.accept(&key, &to);
        tokio::time::sleep(f.slow).await;
        return (StatusCode::OK, Json(json!({ "id": id })));
    }
    if roll < f.p_unavailable + f.p_slow_accepted + f.p_slow_dropped {
        tokio::time::sleep(f.slow).await;
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "overloaded"})),
        );
    }
    let id = app.accept(&key, &to);
    (StatusCode::OK, Json(json!({ "id": id })))
}

async fn lookup(
    State(app): State<Arc<App>>,
    Query(q): Query<HashMap<String, String>>,
) -> (StatusCode, Json<Value>) {
    let key = q.get("key").cloned().unwrap_or_default();
    let found = app
        .book
        .messages
        .lock()
        .unwrap()
        .iter()
        .find(|m| m.key == key)
        .map(|m| m.id.clone());
    match found {
        Some(id) => (StatusCode::OK, Json(json!({ "id": id }))),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no such message"})),
        ),
    }
}

async fn remove(State(app): State<Arc<App>>, Path(id): Path<String>) -> StatusCode {
    if app.book.fail_deletes.load(Ordering::Relaxed) {
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    let mut messages = app.book.messages.lock().unwrap();
    match messages.iter_mut().find(|m| m.id == id) {
        Some(m) => {
            m.deleted = true;
            StatusCode::NO_CONTENT
        }
        None => StatusCode::NOT_FOUND,
    }
}
