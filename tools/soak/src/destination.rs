//! The fake destination: a local server, outside the consumer processes, that accepts sends
//! and records every acceptance, so "performed exactly once" is checked against what the
//! destination saw, not against what a consumer believed. A consumer killed after its send
//! cannot hide the send.
//!
//! Protocol, one request a line, one answer a line, over TCP on 127.0.0.1:
//! `SEND <worker> <effect-key>` → `OK <id>`; `LOOKUP <effect-key>` → `FOUND <id>` | `NONE`;
//! `DELETE <id>` → `OK`. Anything else → `ERR ...`.
//!
//! The crash fault arms a consumer slot: that consumer's next send is accepted and recorded,
//! the soak is told (it SIGKILLs the consumer), and the answer never comes.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_kit::consumer::{Destination, DestinationError, Effect};
use outbox_testkit::checker::Accepted;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

pub const NAME: &str = "soak-destination";

#[derive(Default)]
struct Inner {
    accepted: Vec<Accepted>,
    /// The first accepted id per effect key (what a lookup finds).
    by_key: HashMap<String, String>,
    deleted: HashSet<String>,
    /// Consumer slots whose next send is the crash point.
    armed: HashSet<usize>,
}

/// What the destination holds; shared by the server, the reconciler and the report.
pub struct Book {
    inner: Mutex<Inner>,
    next_id: AtomicU64,
    crashed: mpsc::UnboundedSender<usize>,
}

impl Book {
    /// Records an acceptance; returns the item's id.
    pub fn accept(&self, key: &str) -> String {
        let id = format!("m{}", self.next_id.fetch_add(1, Ordering::Relaxed));
        let mut inner = self.inner.lock().unwrap();
        inner.accepted.push(Accepted {
            effect_key: key.to_owned(),
            external_id: id.clone(),
        });
        inner.by_key.entry(key.to_owned()).or_insert(id.clone());
        id
    }

    pub fn lookup(&self, key: &str) -> Option<String> {
        let inner = self.inner.lock().unwrap();
        inner
            .by_key
            .get(key)
            .filter(|id| !inner.deleted.contains(*id))
            .cloned()
    }

    pub fn delete(&self, id: &str) {
        self.inner.lock().unwrap().deleted.insert(id.to_owned());
    }

    /// What the destination still holds: accepted and not withdrawn (a worker whose claim
    /// was taken over while it was sending deletes its item, as the effects ledger says).
    pub fn live(&self) -> Vec<Accepted> {
        let inner = self.inner.lock().unwrap();
        inner
            .accepted
            .iter()
            .filter(|a| !inner.deleted.contains(&a.external_id))
            .cloned()
            .collect()
    }

    pub fn count(&self) -> usize {
        self.inner.lock().unwrap().accepted.len()
    }

    pub fn deleted(&self) -> usize {
        self.inner.lock().unwrap().deleted.len()
    }

    /// The next send from consumer `slot` becomes its crash point.
    pub fn arm(&self, slot: usize) {
        self.inner.lock().unwrap().armed.insert(slot);
    }

    pub fn disarm(&self, slot: usize) -> bool {
        self.inner.lock().unwrap().armed.remove(&slot)
    }

    /// True when this send is a crash point (and disarms it).
    fn crash_point(&self, worker: &str) -> Option<usize> {
        let slot = slot_of(worker)?;
        self.inner
            .lock()
            .unwrap()
            .armed
            .remove(&slot)
            .then_some(slot)
    }
}

/// Worker names are `c<slot>-<incarnation>`.
pub fn worker_name(slot: usize, incarnation: u32) -> String {
    format!("c{slot}-{incarnation}")
}

fn slot_of(worker: &str) -> Option<usize> {
    worker.strip_prefix('c')?.split('-').next()?.parse().ok()
}

/// Starts the server; returns its address, the book, and the channel on which crash points
/// are announced (the consumer slot that reached one).
pub async fn start() -> (SocketAddr, Arc<Book>, mpsc::UnboundedReceiver<usize>) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1");
    let addr = listener.local_addr().expect("local addr");
    let (tx, rx) = mpsc::unbounded_channel();
    let book = Arc::new(Book {
        inner: Mutex::default(),
        next_id: AtomicU64::new(1),
        crashed: tx,
    });
    let b = book.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve(stream, b.clone()));
        }
    });
    (addr, book, rx)
}

async fn serve(stream: TcpStream, book: Arc<Book>) {
    let (r, mut w) = stream.into_split();
    let mut lines = BufReader::new(r).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let answer = match parts.as_slice() {
            ["SEND", worker, key] => {
                let id = book.accept(key);
                if let Some(slot) = book.crash_point(worker) {
                    // Accepted and recorded; the consumer is killed before it hears so.
                    let _ = book.crashed.send(slot);
                    let _ = lines.next_line().await; // until the socket closes
                    return;
                }
                format!("OK {id}")
            }
            ["LOOKUP", key] => match book.lookup(key) {
                Some(id) => format!("FOUND {id}"),
                None => "NONE".into(),
            },
            ["DELETE", id] => {
                book.delete(id);
                "OK".into()
            }
            _ => format!("ERR unknown request {line:?}"),
        };
        if w.write_all(format!("{answer}\n").as_bytes()).await.is_err() {
            return;
        }
    }
}

/// The destination as a consumer process sees it: a client of the server.
#[derive(Clone)]
pub struct Remote {
    pub addr: SocketAddr,
    pub worker: String,
}

impl Remote {
    /// One request on a fresh connection. A failure to connect means the request never
    /// left (transient); anything after that may have been processed (unknown).
    async fn ask(&self, request: String) -> Result<String, DestinationError> {
        let mut s = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(self.addr))
            .await
            .map_err(|_| DestinationError::Transient("connect timed out".into()))?
            .map_err(|e| DestinationError::Transient(format!("connect: {e}")))?;
        s.write_all(format!("{request}\n").as_bytes())
            .await
            .map_err(|e| DestinationError::Unknown(format!("write: {e}")))?;
        let mut line = String::new();
        BufReader::new(s)
            .read_line(&mut line)
            .await
            .map_err(|e| DestinationError::Unknown(format!("read: {e}")))?;
        if line.is_empty() {
            return Err(DestinationError::Unknown("connection closed".into()));
        }
        Ok(line.trim_end().to_owned())
    }
}

impl Destination for Remote {
    fn name(&self) -> &str {
        NAME
    }

    async fn send(&self, effect: &Effect) -> Result<String, DestinationError> {
        let answer = self
            .ask(format!("SEND {} {}", self.worker, effect.key))
            .await?;
        answer
            .strip_prefix("OK ")
            .map(str::to_owned)
            .ok_or_else(|| DestinationError::Unknown(answer.clone()))
    }

    async fn delete(&self, external_id: &str) -> Result<(), DestinationError> {
        let answer = self.ask(format!("DELETE {external_id}")).await?;
        (answer == "OK")
            .then_some(())
            .ok_or(DestinationError::Transient(answer))
    }

    fn supports_lookup(&self) -> bool {
        true
    }

    async fn lookup(&self, effect: &Effect) -> Result<Option<String>, DestinationError> {
        let answer = self.ask(format!("LOOKUP {}", effect.key)).await?;
        match answer.strip_prefix("FOUND ") {
            Some(id) => Ok(Some(id.to_owned())),
            None if answer == "NONE" => Ok(None),
            None => Err(DestinationError::Transient(answer)),
        }
    }
}

/// The destination as the soak's reconciler sees it: the same book, in process.
#[derive(Clone)]
pub struct Local(pub Arc<Book>);

impl Destination for Local {
    fn name(&self) -> &str {
        NAME
    }

    async fn send(&self, effect: &Effect) -> Result<String, DestinationError> {
        Ok(self.0.accept(&effect.key))
    }

    async fn delete(&self, external_id: &str) -> Result<(), DestinationError> {
        self.0.delete(external_id);
        Ok(())
    }

    fn supports_lookup(&self) -> bool {
        true
    }

    async fn lookup(&self, effect: &Effect) -> Result<Option<String>, DestinationError> {
        Ok(self.0.lookup(&effect.key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn effect(key: &str) -> Effect {
        Effect {
            id: 1,
            key: key.into(),
            destination: NAME.into(),
            payload: serde_json::Value::Null,
            attempts: 1,
        }
    }

    #[tokio::test]
    async fn records_every_send_and_finds_it_by_key() {
        let (addr, book, _rx) = start().await;
        let remote = Remote {
            addr,
            worker: worker_name(0, 1),
        };
        let id = remote.send(&effect("e1")).await.unwrap();
        assert_eq!(
            remote.lookup(&effect("e1")).await.unwrap(),
            Some(id.clone())
        );
        assert_eq!(remote.lookup(&effect("e2")).await.unwrap(), None);
        remote.send(&effect("e1")).await.unwrap();
        assert_eq!(book.count(), 2, "a second send is recorded, not hidden");
        remote.delete(&id).await.unwrap();
        assert_eq!(remote.lookup(&effect("e1")).await.unwrap(), None);
    }

    #[tokio::test]
    async fn an_armed_slot_is_accepted_then_never_answered() {
        let (addr, book, mut crashed) = start().await;
        book.arm(1);
        let other = Remote {
            addr,
            worker: worker_name(0, 1),
        };
        other.send(&effect("a")).await.unwrap();
        let victim = Remote {
            addr,
            worker: worker_name(1, 3),
        };
        let pending = tokio::spawn(async move { victim.send(&effect("b")).await });
        assert_eq!(crashed.recv().await, Some(1));
        assert!(book.lookup("b").is_some(), "accepted before the crash");
        pending.abort();
        assert!(!book.disarm(1), "disarmed by the crash point");
    }
}
