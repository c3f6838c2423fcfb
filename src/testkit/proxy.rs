//! A TCP proxy the tests control: pass bytes through, cut every connection and refuse new
//! ones, or blackhole (accept, forward nothing, keep connections silently open), as a
//! dead network looks to the relay.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Pass,
    /// Close every connection; refuse new ones.
    Cut,
    /// Keep connections open but forward nothing; new ones are accepted and stall.
    Blackhole,
}

pub struct TcpProxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
}

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = watch::channel(Mode::Pass);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let mut rx = rx.clone();
                tokio::spawn(async move {
                    let mode = *rx.borrow_and_update();
                    match mode {
                        Mode::Cut => return,
                        Mode::Blackhole => {
                            // Hold the socket until the mode changes; send nothing.
                            let _ = rx.changed().await;
                            return;
                        }
                        Mode::Pass => {}
                    }
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    relay(client, server, rx).await;
                });
            }
        });
        TcpProxy { addr, mode: tx }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }
}

async fn relay(mut client: TcpStream, mut server: TcpStream, mut rx: watch::Receiver<Mode>) {
    // One copy future for the connection's life: dropping it would lose buffered bytes.
    let copy = tokio::io::copy_bidirectional(&mut client, &mut server);
    tokio::pin!(copy);
    loop {
        tokio::select! {
            _ = &mut copy => return,
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
                let mode = *rx.borrow_and_update();
                match mode {
                    Mode::Pass => continue,
                    // Returning drops both sockets: the peers see the connection end.
                    Mode::Cut => return,
                    Mode::Blackhole => {
                        // Stop polling the copy (nothing is forwarded) but keep both
                        // sockets open until the mode changes.
                        while rx.changed().await.is_ok() {
                            if *rx.borrow_and_update() != Mode::Blackhole {
                                return;
                            }
                        }
                        return;
                    }
                }
            }
        }
    }
}
