//! A TCP proxy the tests and the soak control: pass bytes through, delay them, cut every
//! connection (FIN), reset it (RST), or blackhole it (accept, forward nothing, keep
//! connections silently open), as a slow, broken or dead network looks to the relay.
//!
//! Each connection is two one-way pumps (client → server, server → client). A pump reads a
//! chunk, stamps it with "due at now + the current delay", and writes it when it is due, so
//! a delay adds latency without cutting throughput. Both pumps watch the mode: a change
//! takes effect on live connections at once, not only on new ones.
//!
//! Invariant: bytes are forwarded in order and never dropped while a connection lives;
//! faults end connections (Cut, Reset, the end of a Blackhole), they never corrupt them.
//!
//! A trip wire ([`TcpProxy::trip_on_upstream`]) runs an action the moment a client sends a
//! chunk, before that chunk is forwarded: the soak darkens a relay's Postgres proxy the
//! instant the relay's AMQP proxy carries a publish, so the broker's ack can come back but
//! the mark cannot go out.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Pass,
    /// Close every connection (FIN); refuse new ones.
    Cut,
    /// Keep connections open but forward nothing; new ones are accepted and stall. When the
    /// mode changes again, the blackholed connections are closed.
    Blackhole,
    /// Forward everything, each chunk this much later than it arrived (both directions).
    Delay(Duration),
    /// Reset every connection (RST, as a crashed middlebox or a firewall does); new ones
    /// are accepted and reset at once.
    Reset,
}

/// What the proxy has seen, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections ended by a fault (Cut, Reset, the end of a Blackhole).
    pub broken: u64,
    /// Bytes read from the server side, to be forwarded to clients.
    pub bytes_down: u64,
    /// `bytes_down` when the trip wire last fired: what came from the server after that
    /// came after the tripping chunk was sent.
    pub bytes_down_at_trip: Option<u64>,
}

struct Counters {
    accepted: AtomicU64,
    broken: AtomicU64,
    bytes_down: AtomicU64,
    /// u64::MAX until the trip wire fires.
    bytes_down_at_trip: AtomicU64,
}

impl Default for Counters {
    fn default() -> Counters {
        Counters {
            accepted: AtomicU64::new(0),
            broken: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
            bytes_down_at_trip: AtomicU64::new(u64::MAX),
        }
    }
}

/// Sets a proxy's mode from elsewhere (a trip wire on another proxy).
#[derive(Clone)]
pub struct Switch(Arc<watch::Sender<Mode>>);

impl Switch {
    pub fn set(&self, mode: Mode) {
        self.0.send_replace(mode);
    }
}

/// Says whether a chunk fires the trip wire.
type Fires = Box<dyn Fn(&[u8]) -> bool + Send>;

/// An armed trip wire: which chunk fires it, and the action.
struct Trip {
    fires: Fires,
    action: Box<dyn FnOnce() + Send>,
}

type TripWire = Arc<Mutex<Option<Trip>>>;

pub struct TcpProxy {
    pub addr: SocketAddr,
    mode: Arc<watch::Sender<Mode>>,
    counters: Arc<Counters>,
    trip: TripWire,
    stop: CancellationToken,
}

/// Chunks a pump holds before it stops reading (backpressure while delayed).
const MAX_QUEUED: usize = 256;

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = watch::channel(Mode::Pass);
        let counters = Arc::new(Counters::default());
        let trip: TripWire = Arc::default();
        let stop = CancellationToken::new();
        let c = counters.clone();
        let t = trip.clone();
        let s = stop.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = s.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((client, _)) = accepted else {
                    return;
                };
                c.accepted.fetch_add(1, Ordering::Relaxed);
                let rx = rx.clone();
                let c = c.clone();
                let t = t.clone();
                let s = s.clone();
                tokio::spawn(async move {
                    if connection(client, upstream, rx, &c, t, s).await {
                        c.broken.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
        TcpProxy {
            addr,
            mode: Arc::new(tx),
            counters,
            trip,
            stop,
        }
    }

    /// A handle that sets this proxy's mode (for another proxy's trip wire).
    pub fn switch(&self) -> Switch {
        Switch(self.mode.clone())
    }

    /// Arms a trip wire: the next chunk a client sends for which `fires` says true runs
    /// `action` first, then is forwarded. One shot; a new call replaces an armed wire.
    pub fn trip_on_upstream(
        &self,
        fires: impl Fn(&[u8]) -> bool + Send + 'static,
        action: impl FnOnce() + Send + 'static,
    ) {
        *self.trip.lock().unwrap() = Some(Trip {
            fires: Box::new(fires),
            action: Box::new(action),
        });
    }

    /// Disarms the trip wire; true when it was still armed (it never fired).
    pub fn disarm(&self) -> bool {
        self.trip.lock().unwrap().take().is_some()
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }

    pub fn stats(&self) -> Stats {
        Stats {
            accepted: self.counters.accepted.load(Ordering::Relaxed),
            broken: self.counters.broken.load(Ordering::Relaxed),
            bytes_down: self.counters.bytes_down.load(Ordering::SeqCst),
            bytes_down_at_trip: Some(self.counters.bytes_down_at_trip.load(Ordering::Relaxed))
                .filter(|b| *b != u64::MAX),
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Serves one accepted connection; true when a fault ended it.
async fn connection(
    client: TcpStream,
    upstream: SocketAddr,
    mut rx: watch::Receiver<Mode>,
    counters: &Arc<Counters>,
    trip: TripWire,
    stop: CancellationToken,
) -> bool {
    let mode = *rx.borrow_and_update();
    match mode {
        Mode::Cut => return true,
        Mode::Reset => {
            let _ = client.set_zero_linger();
            return true;
        }
        Mode::Blackhole => {
            // Hold the socket until the mode changes; send nothing.
            tokio::select! {
                _ = rx.changed() => {}
                _ = stop.cancelled() => {}
            }
            return true;
        }
        Mode::Pass | Mode::Delay(_) => {}
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return false;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    // Either pump ending by a fault ends the other one too.
    let done = stop.child_token();
    let up = tokio::spawn(pump(
        cr,
        sw,
        rx.clone(),
        done.clone(),
        Side::Up(trip, counters.clone()),
    ));
    let down = tokio::spawn(pump(sr, cw, rx, done, Side::Down(counters.clone())));
    let (a, b) = (up.await, down.await);
    matches!(a, Ok(true)) || matches!(b, Ok(true))
}

/// Which way a pump copies, with what that side watches.
enum Side {
    /// Client to server: the trip wire (and where to note when it fired).
    Up(TripWire, Arc<Counters>),
    /// Server to client: the byte count.
    Down(Arc<Counters>),
}

impl Side {
    /// A chunk was read, before it is queued for forwarding.
    fn read(&self, chunk: &[u8]) {
        match self {
            Side::Up(trip, c) => {
                let fired = {
                    let mut t = trip.lock().unwrap();
                    match &*t {
                        Some(armed) if (armed.fires)(chunk) => t.take(),
                        _ => None,
                    }
                };
                if let Some(t) = fired {
                    let down = c.bytes_down.load(Ordering::SeqCst);
                    c.bytes_down_at_trip.store(down, Ordering::SeqCst);
                    (t.action)();
                }
            }
            Side::Down(c) => {
                c.bytes_down.fetch_add(chunk.len() as u64, Ordering::SeqCst);
            }
        }
    }
}

/// Copies `src` to `dst` with the current delay until EOF, an error or a fault; true when
/// a fault ended it.
async fn pump(
    mut src: OwnedReadHalf,
    mut dst: OwnedWriteHalf,
    mut rx: watch::Receiver<Mode>,
    done: CancellationToken,
    side: Side,
) -> bool {
    let mut queue: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut written = 0usize; // of the front chunk
    let mut buf = vec![0u8; 16 * 1024];
    let mut eof = false;
    loop {
        let mode = *rx.borrow_and_update();
        let delay = match mode {
            Mode::Pass => Duration::ZERO,
            Mode::Delay(d) => d,
            Mode::Cut => {
                done.cancel();
                return true;
            }
            Mode::Reset => {
                // Both pumps see the mode and do this, so neither socket sends a FIN: the
                // write halves are forgotten (a dropped one would shut down first) and each
                // socket goes with its read half, with linger 0, i.e. as an RST. No
                // `done.cancel()` here: the other pump must not leave by the FIN path.
                let _ = src.as_ref().set_zero_linger();
                let _ = dst.as_ref().set_zero_linger();
                dst.forget();
                return true;
            }
            Mode::Blackhole => {
                tokio::select! {
                    _ = rx.changed() => {}
                    _ = done.cancelled() => {}
                }
                done.cancel();
                return true;
            }
        };
        if eof && queue.is_empty() {
            let _ = dst.shutdown().await;
            return false;
        }
        let due = queue.front().map(|(t, _)| *t);
        let ready = due.is_some_and(|t| t <= Instant::now());
        tokio::select! {
            _ = done.cancelled() => return false,
            changed = rx.changed() => {
                if changed.is_err() {
                    done.cancel();
                    return false;
                }
            }
            r = src.read(&mut buf), if !eof && queue.len() < MAX_QUEUED => match r {
                Ok(0) => eof = true,
                Ok(n) => {
                    side.read(&buf[..n]);
                    queue.push_back((Instant::now() + delay, buf[..n].to_vec()));
                }
                Err(_) => {
                    done.cancel();
                    return false;
                }
            },
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() && !ready => {}
            // `write` (not `write_all`) is cancel-safe: a write that did not complete wrote
            // nothing, so a mode change in the middle loses no bytes.
            w = dst.write(queue.front().map(|(_, b)| &b[written..]).unwrap_or_default()), if ready => match w {
                Ok(n) if n > 0 => {
                    written += n;
                    if written == queue.front().map_or(0, |(_, b)| b.len()) {
                        queue.pop_front();
                        written = 0;
                    }
                }
                _ => {
                    done.cancel();
                    return false;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server: what it reads it writes back.
    async fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut TcpStream, data: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(data).await?;
        let mut out = vec![0u8; data.len()];
        s.read_exact(&mut out).await?;
        Ok(out)
    }

    #[tokio::test]
    async fn passes_bytes_in_order() {
        let proxy = TcpProxy::start(echo().await).await;
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let (mut r, mut w) = s.split();
        let (written, read) = tokio::join!(w.write_all(&data), async {
            let mut out = vec![0u8; data.len()];
            r.read_exact(&mut out).await.map(|_| out)
        });
        written.unwrap();
        assert_eq!(read.unwrap(), data);
        assert_eq!(proxy.stats().accepted, 1);
    }

    #[tokio::test]
    async fn a_trip_wire_switches_another_proxy_before_the_chunk_goes_on() {
        let (a, b) = (
            TcpProxy::start(echo().await).await,
            TcpProxy::start(echo().await).await,
        );
        let mut s = TcpStream::connect(a.addr).await.unwrap();
        let (sw, fired) = (b.switch(), Arc::new(AtomicU64::new(0)));
        let f = fired.clone();
        a.trip_on_upstream(
            |chunk| chunk.len() >= 16,
            move || {
                sw.set(Mode::Blackhole);
                f.fetch_add(1, Ordering::SeqCst);
            },
        );
        // Smaller than the wire: forwarded, nothing fires.
        round_trip(&mut s, b"tiny").await.unwrap();
        assert_eq!((b.mode(), fired.load(Ordering::SeqCst)), (Mode::Pass, 0));
        let big = [7u8; 64];
        assert_eq!(round_trip(&mut s, &big).await.unwrap(), big);
        assert_eq!(b.mode(), Mode::Blackhole);
        assert_eq!(fired.load(Ordering::SeqCst), 1);
        assert!(!a.disarm(), "one shot: the wire is gone once fired");
        assert_eq!(a.stats().bytes_down, 4 + 64);
        assert_eq!(a.stats().bytes_down_at_trip, Some(4));
    }

    #[tokio::test]
    async fn delay_adds_latency_to_live_connections() {
        let proxy = TcpProxy::start(echo().await).await;
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        round_trip(&mut s, b"warm").await.unwrap();
        proxy.set(Mode::Delay(Duration::from_millis(400)));
        let started = std::time::Instant::now();
        assert_eq!(round_trip(&mut s, b"slow").await.unwrap(), b"slow");
        // Delayed once on the way there and once on the way back.
        assert!(started.elapsed() >= Duration::from_millis(800));
        proxy.set(Mode::Pass);
        let started = std::time::Instant::now();
        round_trip(&mut s, b"fast").await.unwrap();
        assert!(started.elapsed() < Duration::from_millis(400));
    }

    #[tokio::test]
    async fn reset_sends_rst_and_refuses_until_pass() {
        let proxy = TcpProxy::start(echo().await).await;
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        round_trip(&mut s, b"hi").await.unwrap();
        proxy.set(Mode::Reset);
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut byte))
            .await
            .expect("the reset reaches the client");
        assert_eq!(
            read.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::ConnectionReset)
        );
        let mut again = TcpStream::connect(proxy.addr).await.unwrap();
        assert!(round_trip(&mut again, b"no").await.is_err());
        proxy.set(Mode::Pass);
        let mut fresh = TcpStream::connect(proxy.addr).await.unwrap();
        assert_eq!(round_trip(&mut fresh, b"ok").await.unwrap(), b"ok");
        assert!(proxy.stats().broken >= 2);
    }

    #[tokio::test]
    async fn blackhole_forwards_nothing_then_closes() {
        let proxy = TcpProxy::start(echo().await).await;
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        round_trip(&mut s, b"hi").await.unwrap();
        proxy.set(Mode::Blackhole);
        s.write_all(b"lost?").await.unwrap();
        let mut buf = [0u8; 5];
        assert!(
            tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf))
                .await
                .is_err(),
            "nothing comes back while blackholed"
        );
        proxy.set(Mode::Pass);
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("closed after the blackhole");
        assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    }

    #[tokio::test]
    async fn cut_closes_and_refuses() {
        let proxy = TcpProxy::start(echo().await).await;
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        round_trip(&mut s, b"hi").await.unwrap();
        proxy.set(Mode::Cut);
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap();
        assert!(matches!(n, Ok(0)), "FIN, not RST: {n:?}");
        let mut again = TcpStream::connect(proxy.addr).await.unwrap();
        assert!(round_trip(&mut again, b"x").await.is_err());
    }
}
