//! A keep-alive HTTP/1.1 backend for tests that drive `keyway run`: it names itself in every
//! answer and counts its connections.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// A keep-alive HTTP/1.1 backend answering `backend=<name>`; counts connections accepted and
/// open now. Dropping it closes the listening socket and every open connection, as a dying
/// process would.
pub struct HttpBackend {
    pub port: u16,
    open: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl HttpBackend {
    pub fn start(name: &'static str) -> HttpBackend {
        Self::start_with(
            name,
            TcpListener::bind("127.0.0.1:0").expect("bind backend"),
        )
    }

    pub fn start_with(name: &'static str, listener: TcpListener) -> HttpBackend {
        let port = listener.local_addr().expect("addr").port();
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = Arc::new(AtomicBool::new(false));
        let open = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::new(AtomicUsize::new(0));
        let (flag, o, a) = (stop.clone(), open.clone(), accepted.clone());
        std::thread::spawn(move || {
            while !flag.load(Ordering::Acquire) {
                match listener.accept() {
                    Ok((s, _)) => {
                        let _ = s.set_nodelay(true);
                        let (flag, o) = (flag.clone(), o.clone());
                        a.fetch_add(1, Ordering::SeqCst);
                        o.fetch_add(1, Ordering::SeqCst);
                        std::thread::spawn(move || {
                            serve_http(s, name, &flag);
                            o.fetch_sub(1, Ordering::SeqCst);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        HttpBackend {
            port,
            open,
            accepted,
            stop,
        }
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for HttpBackend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Let the accept loop and connection threads notice.
        std::thread::sleep(Duration::from_millis(80));
    }
}

fn serve_http(mut s: TcpStream, name: &str, stop: &AtomicBool) {
    let _ = s.set_nonblocking(false);
    let _ = s.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !stop.load(Ordering::Acquire) {
        match s.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(_) => return,
        }
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.drain(..end + 4);
            let body = format!("backend={name}\n");
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n\r\n{body}",
                body.len()
            );
            if s.write_all(resp.as_bytes()).is_err() {
                return;
            }
        }
    }
}
