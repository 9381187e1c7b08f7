//! Two machines from ONE `pdctl up`: two network namespaces joined by a veth pair, an
//! sshd the test starts in the worker's namespace with a key the test makes, and one
//! `pdctl up -d` on the head that starts the worker's supervisor over SSH. Then, from the
//! head only: the cluster serves; `scale` reaches the worker over the TLS channel and a
//! capture of the control port meanwhile holds no plan text; `logs` shows the worker's
//! instances; plain JSON to the control port gets nothing; an authenticated peer's
//! 300 MiB frame is refused with the supervisor staying under 100 MiB; 2,000 silent
//! connections leave `pdctl status` answering within 2 s; `down` takes the worker down.
//! Needs root, iproute2, openssh-server and tcpdump (`./install.sh --deps-only
//! --with-test-deps`); where any is missing the test fails saying which.

use crate::common;
use crate::common::netns;
use crate::common::supervisor as suph;

use common::{ChildGuard, TempDir};
use netns::{NetnsPair, in_netns};
use pdctl::control::StatusReport;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use suph::{Cluster, text};

/// A program on PATH (or in the sbin folders), or the test fails saying how to get it.
fn need(program: &str, package: &str) -> PathBuf {
    for dir in std::env::var("PATH").unwrap_or_default().split(':').chain([
        "/usr/sbin",
        "/sbin",
        "/usr/bin",
    ]) {
        let p = Path::new(dir).join(program);
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "this test needs `{program}` (Debian package {package}): ./install.sh --deps-only --with-test-deps installs it"
    );
}

fn sh(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", text(&out));
}

/// An sshd in namespace `ns` listening at `addr`, letting in root with the key `id` the
/// test makes; sessions get `PDCTL_STATE_DIR=state_root` and `HOME=home`.
fn start_sshd(ns: &str, addr: &str, dir: &Path, state_root: &Path, home: &Path) -> ChildGuard {
    let sshd = need("sshd", "openssh-server");
    let keygen = need("ssh-keygen", "openssh-client");
    for key in ["id", "host_key"] {
        sh(Command::new(&keygen)
            .args(["-q", "-t", "ed25519", "-N", ""])
            .arg("-f")
            .arg(dir.join(key)));
    }
    std::fs::copy(dir.join("id.pub"), dir.join("authorized_keys")).unwrap();
    std::fs::create_dir_all("/run/sshd").unwrap();
    let config = format!(
        "Port 22\nListenAddress {addr}\nHostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\n\
         PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n\
         UsePAM no\nStrictModes no\nPidFile {d}/sshd.pid\n\
         SetEnv PDCTL_STATE_DIR={state} HOME={home}\n",
        d = dir.display(),
        state = state_root.display(),
        home = home.display(),
    );
    let cfg = dir.join("sshd_config");
    std::fs::write(&cfg, config).unwrap();
    let log = std::fs::File::create(dir.join("sshd.log")).unwrap();
    let child = NetnsPair::exec(ns, &sshd)
        .args(["-D", "-e", "-f"])
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start sshd");
    ChildGuard(child)
}

/// The ssh command pdctl is told to use: the test's key, no known_hosts prompt.
fn ssh_command(dir: &Path) -> String {
    format!(
        "ssh -i {}/id -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes -o LogLevel=ERROR -o ConnectTimeout=10",
        dir.display()
    )
}

fn connects(ns: &str, addr: &str, port: u16) -> bool {
    let addr = format!("{addr}:{port}");
    in_netns(Some(ns), move || {
        std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_millis(500))
            .is_ok()
    })
}

/// Resident memory of process `pid` in bytes (0 when it is gone).
fn rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// A completion through the proxy at `addr:port` from namespace `ns`: its HTTP status
/// line and body.
fn complete(ns: &str, addr: &str, port: u16) -> String {
    complete_with_key(ns, addr, port, None)
}

/// [`complete`] sending `Authorization: Bearer KEY` when a key is given.
fn complete_with_key(ns: &str, addr: &str, port: u16, key: Option<&str>) -> String {
    let to = format!("{addr}:{port}");
    let auth = key
        .map(|k| format!("authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    in_netns(Some(ns), move || {
        let body = r#"{"model":"sim-model","prompt":"San Francisco is a","max_tokens":8}"#;
        let mut s = std::net::TcpStream::connect(&to).expect("the proxy");
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
}

/// Two namespaces with an sshd in the worker's, the two nodes' state roots, and a
/// topology (prefill and proxy on the head, decode on the worker reached over ssh).
struct Setup {
    pair: NetnsPair,
    dir: TempDir,
    head: Cluster,
    worker: Cluster,
    _sshd: ChildGuard,
    run: u16,
    control: u16,
    file: PathBuf,
}

impl Setup {
    fn new(tag: &str) -> Setup {
        let pair = NetnsPair::create(tag).unwrap_or_else(|why| {
            panic!("this test needs two network namespaces (root and iproute2): {why}")
        });
        let dir = TempDir::new(&format!("{tag}-ssh"));
        let (head, worker) = (
            Cluster::new(&format!("{tag}head")),
            Cluster::new(&format!("{tag}work")),
        );
        let home = dir.path().join("worker-home");
        std::fs::create_dir_all(&home).unwrap();
        let sshd = start_sshd(&pair.b, &pair.addr_b, dir.path(), worker.root(), &home);
        assert!(
            common::wait_until(Duration::from_secs(10), || connects(
                &pair.a,
                &pair.addr_b,
                22
            )),
            "sshd did not listen: {}",
            std::fs::read_to_string(dir.path().join("sshd.log")).unwrap_or_default()
        );
        let run = suph::free_port_run(12);
        let control = run + 11;
        let topology = format!(
            "cluster = \"pd35\"\nhead = \"head\"\n\
             [nodes]\nhead = \"{a}\"\nworker = {{ address = \"{b}\", ssh = \"root@{b}\" }}\n\
             [model]\nname = \"sim-model\"\n[engine]\nkind = \"sim\"\n\
             [connector]\nkind = \"nixl\"\n\
             [prefill]\ninstances = 1\nnode = \"head\"\nbase_port = {}\n\
             [decode]\ninstances = 1\nnodes = [\"worker\"]\nbase_port = {}\n\
             [control]\nport = {control}\n\
             [proxy]\nport = {run}\n",
            run + 2,
            run + 6,
            a = pair.addr_a,
            b = pair.addr_b,
        );
        let file = dir.path().join("topology.toml");
        std::fs::write(&file, &topology).unwrap();
        Setup {
            pair,
            dir,
            head,
            worker,
            _sshd: sshd,
            run,
            control,
            file,
        }
    }

    /// A pdctl command of the head, in its namespace, with the test's ssh command.
    fn on_head(&self, args: &[&str]) -> Command {
        let mut c = NetnsPair::wrap(Some(&self.pair.a), self.head.command(args));
        c.env("PDCTL_SSH_COMMAND", ssh_command(self.dir.path()));
        c
    }
}

#[test]
fn one_up_on_the_head_starts_the_worker_over_ssh_behind_mutual_tls() {
    let tcpdump = need("tcpdump", "tcpdump");
    let setup = Setup::new("pd35");
    let Setup {
        pair,
        dir,
        head,
        worker,
        run,
        control,
        file,
        ..
    } = &setup;
    let (run, control) = (*run, *control);
    let f = file.to_str().unwrap();
    let on_head = |args: &[&str]| setup.on_head(args);

    // One command, on the head.
    let t0 = Instant::now();
    let up = suph::run_bounded(on_head(&["up", "-d", "-f", f]), Duration::from_secs(180));
    assert!(up.status.success(), "up -d: {}", text(&up));
    let said = String::from_utf8_lossy(&up.stdout);
    eprintln!("{said}");
    assert!(
        said.contains("node worker (root@") && said.contains("starting its supervisor over ssh"),
        "{said}"
    );
    eprintln!(
        "one `pdctl up -d` brought both nodes up in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let r = head.wait_status(Duration::from_secs(30), &[], |r| {
        suph::all_healthy(r) && suph::svc(r, "decode-0").pid.is_some()
    });
    assert!(suph::all_healthy(&r), "{r:?}");
    assert!(suph::svc(&r, "decode-0").remote, "{r:?}");
    let answer = complete(&pair.a, &pair.addr_a, run);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"choices\""), "{answer}");

    // `scale` from the head reaches the worker; the control port carries no plan text.
    let capture = dir.path().join("control.pcap");
    let mut dump = ChildGuard(
        NetnsPair::exec(&pair.a, &tcpdump)
            .args(["-i", "any", "-U", "-s", "0", "-w"])
            .arg(&capture)
            .args(["tcp", "port", &control.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tcpdump"),
    );
    std::thread::sleep(Duration::from_secs(2));
    let scale = suph::run_bounded(on_head(&["scale", "decode=2"]), Duration::from_secs(90));
    assert!(scale.status.success(), "scale: {}", text(&scale));
    std::thread::sleep(Duration::from_secs(2));
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dump.pid() as i32),
        nix::sys::signal::Signal::SIGINT,
    );
    let _ = dump.0.wait();
    let packets = std::fs::read(&capture).expect("the capture");
    assert!(
        packets.len() > 4096,
        "the capture holds {} bytes: no control traffic was seen",
        packets.len()
    );
    let plain = ["sim-model", "argv", "\"cmd\"", "decode-1", "\"add\""];
    for word in plain {
        assert!(
            !packets.windows(word.len()).any(|w| w == word.as_bytes()),
            "`{word}` crossed the control port in clear ({} bytes captured)",
            packets.len()
        );
    }
    let r = head.wait_status(Duration::from_secs(30), &[], |r| {
        suph::all_healthy(r) && r.services.iter().any(|s| s.name == "decode-1")
    });
    let decode1 = suph::svc(&r, "decode-1");
    assert!(decode1.remote && decode1.pid.is_some(), "{r:?}");

    // `logs` on the head shows the worker's instances.
    let logs = head.run(&["logs", "decode", "-n", "5"]);
    assert!(logs.status.success(), "logs: {}", text(&logs));
    let shown = String::from_utf8_lossy(&logs.stdout);
    for name in ["decode-0", "decode-1"] {
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with(name) && l.contains('|')),
            "{name} in:\n{shown}"
        );
    }

    // Plain JSON to the control port gets nothing.
    let to = format!("{}:{control}", pair.addr_b);
    let heard = in_netns(Some(&pair.a), move || {
        let mut s = std::net::TcpStream::connect(&to).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(6))).unwrap();
        let _ = s.write_all(b"{\"cmd\":\"status\"}\n");
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        got
    });
    let heard_text = String::from_utf8_lossy(&heard);
    assert!(
        !heard_text.contains('{') && heard.len() < 64,
        "plain JSON got an answer: {heard_text:?}"
    );

    a_worker_cannot_make_the_head_run_anything(pair, head, worker, control);
    a_join_trusts_only_the_pinned_ca(pair, head, control);
    oversized_frame_is_refused(pair, head, worker, control);
    silent_connections_leave_status_answering(pair, head, control);
    strangers_leave_the_worker_reachable(pair, head, control);

    // `down` on the head takes the worker down too.
    let worker_pid = worker_supervisor(worker);
    let down = head.run(&["down"]);
    assert!(down.status.success(), "down: {}", text(&down));
    assert!(
        common::wait_until(Duration::from_secs(15), || rss(worker_pid) == 0),
        "the worker's supervisor (pid {worker_pid}) still runs after `down` on the head"
    );
}

/// The worker's supervisor pid, from its run record.
fn worker_supervisor(worker: &Cluster) -> i32 {
    let state = pdctl::supervisor::StateDir::new(worker.root().join("pd35-worker"));
    pdctl::supervisor::read_record(&state)
        .ok()
        .flatten()
        .expect("the worker's run record")
        .supervisor_pid
}

/// One request over the channel as node `creds.node`, to `node` at `addr`: the answer line.
fn ask_as(
    ns: &str,
    creds: pdctl::control::tls::NodeCreds,
    addr: String,
    node: &'static str,
    line: &'static str,
) -> String {
    use pdctl::control::tls::PeerTls;
    in_netns(Some(ns), move || {
        let nodes = vec!["head".to_string(), "worker".to_string()];
        let tls = PeerTls::new("pd35", "head", nodes, &creds, None).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = pdctl::control::client::open_peer(&addr, node, &tls)
                .await
                .expect("a node's certificate is accepted");
            s.write_all(line.as_bytes()).await.unwrap();
            s.write_all(b"\n").await.unwrap();
            s.flush().await.unwrap();
            let mut answer = vec![0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut answer))
                .await
                .expect("an answer")
                .unwrap();
            String::from_utf8_lossy(&answer[..n]).into_owned()
        })
    })
}

/// The worker's own certificate may ask the head for its status, and for nothing that
/// runs, stops or changes a service; a cluster-wide change is no peer request at all.
fn a_worker_cannot_make_the_head_run_anything(
    pair: &NetnsPair,
    head: &Cluster,
    worker: &Cluster,
    control: u16,
) {
    use pdctl::control::tls::{NodeCreds, TLS_DIR};
    let creds = NodeCreds::read(&worker.root().join("pd35-worker").join(TLS_DIR))
        .unwrap()
        .expect("the worker's certificate");
    let to = format!("{}:{control}", pair.addr_a);
    let status = ask_as(
        &pair.b,
        creds.clone(),
        to.clone(),
        "head",
        r#"{"cmd":"status"}"#,
    );
    assert!(status.contains(r#""reply":"status""#), "{status}");
    let restart = ask_as(
        &pair.b,
        creds.clone(),
        to.clone(),
        "head",
        r#"{"cmd":"restart","service":"prefill-0"}"#,
    );
    assert!(
        restart.contains("only the head") && restart.contains(r#""reply":"error""#),
        "{restart}"
    );
    let change = ask_as(
        &pair.b,
        creds,
        to,
        "head",
        r#"{"cmd":"change","change":{"scale":{"counts":{"decode":3}}}}"#,
    );
    assert!(change.contains(r#""reply":"error""#), "{change}");
    let r = head.status(&[]).expect("the head's status");
    assert_eq!(suph::svc(&r, "prefill-0").restarts, 0, "{r:?}");
}

/// A join token that pins another CA than the head's is refused by the joining side,
/// secret or not; with the head's CA pinned the join reaches the head, which answers
/// (here: refuses a wrong secret; a token that joins would revoke the worker's
/// certificate, which tests/security.rs shows).
fn a_join_trusts_only_the_pinned_ca(pair: &NetnsPair, head: &Cluster, control: u16) {
    use pdctl::control::tls::JoinToken;
    let out = head.run(&["join-token", "--node", "worker"]);
    assert!(out.status.success(), "join-token: {}", text(&out));
    let token = JoinToken::parse(&String::from_utf8_lossy(&out.stdout)).unwrap();
    let other = JoinToken {
        ca_hash: "0".repeat(64),
        id: token.id.clone(),
        secret: token.secret.clone(),
    };
    let pinned_right = JoinToken {
        secret: pdctl::control::tls::TokenSecret::random(),
        ..token.clone()
    };
    let to = format!("{}:{control}", pair.addr_a);
    let (pinned_elsewhere, right) = in_netns(Some(&pair.b), move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let join = |t: &JoinToken| {
            rt.block_on(pdctl::control::client::join(
                &to,
                "head",
                "worker",
                t,
                Duration::from_secs(5),
            ))
        };
        (
            join(&other).map(|j| j.creds.node),
            join(&pinned_right).map(|j| j.creds.node),
        )
    });
    let err = pinned_elsewhere
        .expect_err("an unpinned CA must not be trusted")
        .to_string();
    assert!(err.contains("pins"), "{err}");
    let err = right.expect_err("a wrong secret").to_string();
    assert!(err.contains("wrong join token"), "the head answered: {err}");
}

/// The head's own certificate (an authenticated peer) sends the worker a 300 MiB frame:
/// refused without being echoed, the worker's supervisor under 100 MiB throughout.
fn oversized_frame_is_refused(pair: &NetnsPair, head: &Cluster, worker: &Cluster, control: u16) {
    use pdctl::control::tls::{NodeCreds, PeerTls, TLS_DIR};
    let pid = worker_supervisor(worker);
    let creds = NodeCreds::read(&head.root().join("pd35-head").join(TLS_DIR))
        .unwrap()
        .expect("the head's certificate");
    let nodes = vec!["head".to_string(), "worker".to_string()];
    let tls = PeerTls::new("pd35", "head", nodes, &creds, None).unwrap();
    let before = rss(pid);
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(before));
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        std::thread::spawn(move || {
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(rss(pid), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let to = format!("{}:{control}", pair.addr_b);
    let (sent, answer) = in_netns(Some(&pair.a), move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = pdctl::control::client::open_peer(&to, "worker", &tls)
                .await
                .expect("the head's certificate is accepted");
            let chunk = vec![b'x'; 1 << 20];
            let mut sent = 0usize;
            while sent < 300 << 20 {
                if s.write_all(&chunk).await.is_err() {
                    break;
                }
                sent += chunk.len();
            }
            let mut answer = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer)).await;
            (sent, answer)
        })
    });
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    let answer = String::from_utf8_lossy(&answer);
    eprintln!(
        "300 MiB frame: {} MiB written before the worker closed; its supervisor {} MiB before, {} MiB at most",
        sent >> 20,
        before >> 20,
        peak >> 20
    );
    assert!(
        peak < 100 << 20,
        "the worker's supervisor grew to {} MiB",
        peak >> 20
    );
    assert!(
        answer.contains("longer than") && answer.len() < 1024,
        "the frame was not refused plainly: {answer:?}"
    );
    assert!(rss(pid) > 0, "the worker's supervisor died");
}

/// 2,000 connections that never say a word, from the worker's namespace to the head's
/// control port: `pdctl status` on the head still answers within 2 s.
fn silent_connections_leave_status_answering(pair: &NetnsPair, head: &Cluster, control: u16) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    assert!(
        hard > 2200,
        "the open-file limit ({hard}) is too low for 2,000 connections"
    );
    let to = format!("{}:{control}", pair.addr_a);
    let (tx, rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let ns = pair.b.clone();
    let holder = std::thread::spawn(move || {
        in_netns(Some(&ns), move || {
            let streams: Vec<_> = (0..2000)
                .filter_map(|_| std::net::TcpStream::connect(&to).ok())
                .collect();
            tx.send(streams.len()).unwrap();
            let _ = done_rx.recv_timeout(Duration::from_secs(60));
            drop(streams);
        })
    });
    let opened = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the connections");
    let t0 = Instant::now();
    let out = head.run(&["status", "--json"]);
    let took = t0.elapsed();
    done_tx.send(()).unwrap();
    holder.join().unwrap();
    eprintln!(
        "{opened} silent connections: `pdctl status` answered in {} ms",
        took.as_millis()
    );
    let report: StatusReport = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("status under the flood: {}", text(&out)));
    assert!(suph::all_healthy(&report), "{report:?}");
    assert!(took < Duration::from_secs(2), "status took {took:?}");
}

/// `pdctl up` in the foreground on the head starts the worker over ssh too, and Ctrl-C on
/// it takes the worker down with the head.
#[test]
fn a_foreground_up_starts_the_worker_and_takes_it_down_on_ctrl_c() {
    let setup = Setup::new("pd35f");
    let f = setup.file.to_str().unwrap();
    let up = ChildGuard(
        setup
            .on_head(&["up", "-f", f])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("pdctl up"),
    );
    assert!(
        common::wait_until(Duration::from_secs(60), || setup.head.status(&[]).is_some()),
        "the head's `up` did not start its supervisor"
    );
    let r = setup.head.wait_status(Duration::from_secs(90), &[], |r| {
        suph::all_healthy(r) && suph::svc(r, "decode-0").pid.is_some()
    });
    assert!(suph::all_healthy(&r), "{r:?}");
    let worker_pid = worker_supervisor(&setup.worker);
    assert!(rss(worker_pid) > 0, "the worker's supervisor runs");
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(up.pid() as i32),
        nix::sys::signal::Signal::SIGINT,
    );
    assert!(
        common::wait_until(Duration::from_secs(30), || rss(worker_pid) == 0),
        "the worker's supervisor (pid {worker_pid}) still runs after Ctrl-C on the head's `up`"
    );
    assert!(
        common::wait_until(Duration::from_secs(30), || rss(up.pid() as i32) == 0
            || std::fs::read_to_string(format!("/proc/{}/stat", up.pid()))
                .is_ok_and(|s| s.contains(") Z "))),
        "the head's `up` did not end after Ctrl-C"
    );
}

/// A node the head cannot reach over ssh stops `up` before anything starts, naming the
/// node and what ssh said (loopback addresses: no namespaces needed).
#[test]
fn an_unreachable_ssh_node_stops_up_before_anything_starts() {
    let dir = TempDir::new("pd35u");
    let head = Cluster::new("pd35uhead");
    let run = suph::free_port_run(12);
    let closed = common::free_port();
    let topology = format!(
        "cluster = \"pd35u\"\nhead = \"head\"\n\
         [nodes]\nhead = \"127.0.0.1\"\nworker = {{ address = \"127.0.0.3\", ssh = \"root@127.0.0.3\" }}\n\
         [model]\nname = \"sim-model\"\n[engine]\nkind = \"sim\"\n\
         [connector]\nkind = \"nixl\"\n\
         [prefill]\ninstances = 1\nnode = \"head\"\nbase_port = {}\n\
         [decode]\ninstances = 1\nnodes = [\"worker\"]\nbase_port = {}\n\
         [control]\nport = {}\n[proxy]\nport = {run}\n",
        run + 2,
        run + 6,
        run + 11,
    );
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, topology).unwrap();
    let mut up = head.command(&["up", "-d", "-f", file.to_str().unwrap()]);
    up.env(
        "PDCTL_SSH_COMMAND",
        format!("ssh -p {closed} -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectTimeout=5"),
    );
    let out = suph::run_bounded(up, Duration::from_secs(60));
    assert!(!out.status.success(), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains("node worker (root@127.0.0.3)") && said.contains("ssh exited"),
        "{said}"
    );
    assert!(
        head.status(&[]).is_none(),
        "something was left running: {said}"
    );
}

/// A proxy on the worker, with `PDCTL_API_KEY` set for the head's `up`: the head hands the
/// key over ssh in the worker's bundle, and the worker's proxy answers 401 without it and
/// 200 with it; the key is in no process's argv, in no log, and kept 0600 on the worker.
#[test]
fn a_workers_proxy_requires_the_client_key_the_head_was_given() {
    let setup = Setup::new("pd45k");
    let topology = std::fs::read_to_string(&setup.file).unwrap();
    let moved = topology.replace("[proxy]\n", "[proxy]\nnode = \"worker\"\n");
    assert_ne!(moved, topology);
    std::fs::write(&setup.file, moved).unwrap();
    let key = format!("client-key-{:016x}", rand::random::<u64>());
    let f = setup.file.to_str().unwrap();
    let mut up = setup.on_head(&["up", "-d", "-f", f]);
    up.env("PDCTL_API_KEY", &key);
    let up = suph::run_bounded(up, Duration::from_secs(180));
    assert!(up.status.success(), "up -d: {}", text(&up));
    let r = setup
        .head
        .wait_status(Duration::from_secs(60), &[], suph::all_healthy);
    assert!(suph::all_healthy(&r), "{r:?}");
    assert!(suph::svc(&r, "proxy").remote, "{r:?}");
    let (pair, run) = (&setup.pair, setup.run);
    let without = complete_with_key(&pair.a, &pair.addr_b, run, None);
    assert!(without.starts_with("HTTP/1.1 401"), "{without}");
    let wrong = complete_with_key(&pair.a, &pair.addr_b, run, Some("not-the-key"));
    assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
    let with = complete_with_key(&pair.a, &pair.addr_b, run, Some(&key));
    assert!(with.starts_with("HTTP/1.1 200"), "{with}");

    let state = setup.worker.root().join("pd35-worker");
    let kept = state.join(pdctl::control::auth::CLIENT_KEY_FILE);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&kept).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(std::fs::read_to_string(&kept).unwrap().trim(), key);
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        assert!(
            !cmdline.windows(key.len()).any(|w| w == key.as_bytes()),
            "the client key is in the argv of {}",
            e.path().display()
        );
    }
    let worker_pid = worker_supervisor(&setup.worker);
    let environ = std::fs::read(format!("/proc/{worker_pid}/environ")).unwrap_or_default();
    assert!(
        !environ.windows(key.len()).any(|w| w == key.as_bytes()),
        "the worker's supervisor has the client key in its environment"
    );
    let mut logs = Vec::new();
    for root in [setup.worker.root(), setup.head.root()] {
        for e in walk(root) {
            if e.to_string_lossy().contains("/logs/") {
                logs.push(e);
            }
        }
    }
    assert!(!logs.is_empty());
    for log in logs {
        let t = std::fs::read(&log).unwrap_or_default();
        assert!(
            !t.windows(key.len()).any(|w| w == key.as_bytes()),
            "the client key is in {}",
            log.display()
        );
    }
    let down = setup.head.run(&["down"]);
    assert!(down.status.success(), "down: {}", text(&down));
}

/// Every file under `dir`, depth first.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// 64 silent connections from 8 addresses that are no node's (8 each, opened again as
/// soon as the worker closes one) held on the worker's control port for 30 s: the head's
/// status shows the worker reachable and its services healthy throughout (the nodes have
/// handshake places of their own, and the head polls over one kept connection).
fn strangers_leave_the_worker_reachable(pair: &NetnsPair, head: &Cluster, control: u16) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let sources: Vec<String> = (0..8)
        .map(|i| {
            pair.add_address_a(100 + i)
                .expect("an extra address on the head's side")
        })
        .collect();
    let to: std::net::SocketAddr = format!("{}:{control}", pair.addr_b).parse().unwrap();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let opened = std::sync::Arc::new(AtomicUsize::new(0));
    let ns = pair.a.clone();
    let flood = {
        let (stop, opened) = (stop.clone(), opened.clone());
        std::thread::spawn(move || {
            in_netns(Some(&ns), move || {
                let connect = |from: &str| {
                    let s =
                        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                            .ok()?;
                    let bind: std::net::SocketAddr = format!("{from}:0").parse().unwrap();
                    s.bind(&bind.into()).ok()?;
                    s.connect_timeout(&to.into(), Duration::from_secs(1)).ok()?;
                    s.set_nonblocking(true).ok()?;
                    opened.fetch_add(1, Ordering::Relaxed);
                    Some(std::net::TcpStream::from(s))
                };
                let mut held: Vec<(usize, Option<std::net::TcpStream>)> =
                    (0..64).map(|i| (i / 8, None)).collect();
                while !stop.load(Ordering::Relaxed) {
                    for (src, conn) in held.iter_mut() {
                        let closed = conn.as_ref().is_none_or(|c| {
                            let mut b = [0u8; 1];
                            !matches!(c.peek(&mut b), Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock)
                        });
                        if closed {
                            *conn = connect(&sources[*src]);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        })
    };
    let t0 = Instant::now();
    let mut looks = 0;
    while t0.elapsed() < Duration::from_secs(30) {
        let r = head.status(&[]).expect("the head's status");
        let decode = suph::svc(&r, "decode-0");
        assert!(
            suph::all_healthy(&r) && decode.remote && decode.pid.is_some(),
            "after {:.1} s of strangers ({} connections opened): {r:?}",
            t0.elapsed().as_secs_f64(),
            opened.load(Ordering::Relaxed)
        );
        looks += 1;
        std::thread::sleep(Duration::from_secs(1));
    }
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    let opened = opened.load(Ordering::Relaxed);
    eprintln!(
        "strangers: {opened} connections from 8 addresses in 30 s; the worker healthy in all {looks} looks at the head's status"
    );
    assert!(opened >= 64, "the strangers got only {opened} connections");
}

/// The head's `up` fails after it started the worker over ssh (its own prefill does not
/// get healthy within its start-up time): the worker it started is taken down again,
/// nothing is left running there.
#[test]
fn a_failed_up_takes_down_the_nodes_it_started() {
    let setup = Setup::new("pd45d");
    let topology = std::fs::read_to_string(&setup.file).unwrap();
    let broken = topology.replace(
        "[prefill]\ninstances = 1\n",
        "[prefill]\ninstances = 1\nargs = [\"--startup-ms\", \"600000\"]\nstartup_timeout_s = 3\nrestart = \"never\"\n",
    );
    assert_ne!(broken, topology);
    std::fs::write(&setup.file, broken).unwrap();
    let f = setup.file.to_str().unwrap();
    let up = suph::run_bounded(
        setup.on_head(&["up", "-d", "-f", f]),
        Duration::from_secs(240),
    );
    let said = text(&up);
    assert!(!up.status.success(), "{said}");
    assert!(said.contains("starting its supervisor over ssh"), "{said}");
    assert!(
        said.contains("node worker (root@") && said.contains("taken down"),
        "{said}"
    );
    let state = pdctl::supervisor::StateDir::new(setup.worker.root().join("pd35-worker"));
    let left = pdctl::supervisor::read_record(&state)
        .ok()
        .flatten()
        .filter(|r| r.supervisor_alive());
    assert!(
        left.is_none(),
        "the worker's supervisor still runs: {left:?}\n{said}"
    );
    // The head's own supervisor stays for a look at what failed, as on one node.
    let down = setup.head.run(&["down"]);
    assert!(down.status.success(), "down: {}", text(&down));
}

/// Issue 47 over SSH: the head runs no engine; the worker's `node-up` fetches the model
/// (from a stand-in hub only the worker reaches) before its engines start, and the head's
/// `up` and `status` show that fetch as it goes; a `scale` on the head that adds an engine on the
/// worker has the worker's supervisor fetch it first (once).
#[test]
fn the_worker_fetches_the_model_before_its_engines_start_at_up_and_at_scale() {
    use crate::common::hub::{self, Hub};
    let pair = NetnsPair::create("pd47").unwrap_or_else(|why| {
        panic!("this test needs two network namespaces (root and iproute2): {why}")
    });
    let dir = TempDir::new("pd47-ssh");
    let (head, worker) = (Cluster::new("pd47head"), Cluster::new("pd47work"));
    let home = dir.path().join("worker-home");
    std::fs::create_dir_all(&home).unwrap();
    let _sshd = start_sshd(&pair.b, &pair.addr_b, dir.path(), worker.root(), &home);
    assert!(
        common::wait_until(Duration::from_secs(10), || connects(
            &pair.a,
            &pair.addr_b,
            22
        )),
        "sshd did not listen"
    );
    let repo = dir.path().join("repo");
    hub::tiny_repo(&repo);
    // About 256 KiB/s: some eight seconds of the worker fetching to look at.
    let hub = Hub::start_in(
        Some(&pair.b),
        dir.path(),
        &[("org/tiny", &repo)],
        &["--rate", "262144"],
    );
    let python = hub::fake_vllm(dir.path());
    let cache = dir.path().join("worker-cache");
    let run = suph::free_port_run(12);
    let control = run + 11;
    let topology = format!(
        "cluster = \"pd47\"\nhead = \"head\"\n\
         [nodes]\nhead = \"{a}\"\nworker = {{ address = \"{b}\", ssh = \"root@{b}\" }}\n\
         [model]\nname = \"org/tiny\"\nmax_model_len = 4096\n\
         [engine]\nvllm_version = \"0.26.0\"\ndevice = \"cpu\"\npython = \"{}\"\n\
         [engine.env]\nHF_ENDPOINT = \"{}\"\nHF_HUB_CACHE = \"{}\"\n\
         [connector]\nkind = \"nixl\"\nside_channel_port = {}\n\
         [prefill]\ninstances = 1\nnodes = [\"worker\"]\nbase_port = {}\n\
         [decode]\ninstances = 1\nnodes = [\"worker\"]\nbase_port = {}\n\
         [control]\nport = {control}\n\
         [proxy]\nport = {run}\n",
        python.display(),
        hub.endpoint(),
        cache.display(),
        run + 9,
        run + 1,
        run + 5,
        a = pair.addr_a,
        b = pair.addr_b,
    );
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, &topology).unwrap();
    let mut up = NetnsPair::wrap(
        Some(&pair.a),
        head.command(&["up", "-d", "-f", file.to_str().unwrap()]),
    );
    up.env("PDCTL_SSH_COMMAND", ssh_command(dir.path()))
        .env_remove("HF_TOKEN");
    let up = up
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Meanwhile the head's `status` shows the worker's fetch (its services wait for it).
    let mut seen = None;
    common::wait_until(Duration::from_secs(60), || {
        let out = head.run(&["status", "--json"]);
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let f = &doc["fetching"][0];
        if f["node"] == "worker" && f["done"].as_u64() > Some(0) {
            seen = Some(doc.clone());
            return true;
        }
        false
    });
    let doc = seen.expect("the head's status --json never showed the worker's fetch");
    let f = &doc["fetching"][0];
    assert_eq!(f["model"], "org/tiny", "{doc}");
    assert!(
        f["text"].as_str().unwrap().starts_with("fetching model ")
            && f["text"].as_str().unwrap().contains(" / 2.00 MiB ("),
        "{doc}"
    );
    let shown = String::from_utf8_lossy(&head.run(&["status"]).stdout).into_owned();
    assert!(
        shown.contains("node worker: fetching model ")
            && shown.contains("(org/tiny); its services start once it is there"),
        "{shown}"
    );
    let out = up.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "up -d: {}", text(&out));
    assert!(
        head.run(&["status", "--json"])
            .stdout
            .windows(10)
            .all(|w| w != b"\"fetching\""),
        "the fetch is still shown after it ended"
    );
    assert!(
        said.contains("pdctl: node worker: fetching org/tiny for node worker from")
            && said.contains("pdctl: node worker: fetched org/tiny 2.0 MiB"),
        "{said}"
    );
    let snaps = cache.join("models--org--tiny/snapshots");
    assert_eq!(
        std::fs::read_dir(&snaps).map(|d| d.count()).unwrap_or(0),
        1,
        "{said}"
    );
    let r = head.wait_status(Duration::from_secs(30), &[], suph::all_healthy);
    assert!(suph::all_healthy(&r), "{r:?}");
    // The head reconciles a node that joined late (it was fetching): a change waits for
    // that to end.
    let t = Instant::now();
    let r = head.wait_status(Duration::from_secs(60), &[], |r| {
        r.operation.as_ref().is_none_or(|o| o.outcome.is_some())
    });
    assert!(
        r.operation.as_ref().is_none_or(|o| o.outcome.is_some()),
        "{r:?}"
    );
    eprintln!(
        "the head's reconcile of the late worker ended {:.1} s after up -d returned",
        t.elapsed().as_secs_f64()
    );

    // The worker's cache loses the model: `scale` on the head has the worker's supervisor
    // fetch it before decode-1 starts there.
    std::fs::remove_dir_all(&cache).unwrap();
    let scale = suph::run_bounded(
        NetnsPair::wrap(Some(&pair.a), head.command(&["scale", "decode=2"])),
        Duration::from_secs(120),
    );
    let said = String::from_utf8_lossy(&scale.stdout).into_owned();
    assert!(scale.status.success(), "scale: {}", text(&scale));
    let fetched = said
        .find("pdctl: node worker: fetched org/tiny into")
        .unwrap_or_else(|| panic!("{said}"));
    let starting = said
        .find("pdctl: starting decode-1")
        .unwrap_or_else(|| panic!("{said}"));
    assert!(fetched < starting, "{said}");
    assert_eq!(
        std::fs::read_dir(&snaps).map(|d| d.count()).unwrap_or(0),
        1,
        "{said}"
    );
    let r = head.wait_status(Duration::from_secs(30), &[], |r| {
        suph::all_healthy(r) && r.services.iter().any(|s| s.name == "decode-1")
    });
    assert!(suph::all_healthy(&r), "{r:?}");
    // With the model there, the next one fetches nothing.
    let scale = suph::run_bounded(
        NetnsPair::wrap(Some(&pair.a), head.command(&["scale", "decode=3"])),
        Duration::from_secs(120),
    );
    let said = String::from_utf8_lossy(&scale.stdout).into_owned();
    assert!(scale.status.success(), "scale: {}", text(&scale));
    assert!(
        said.contains("org/tiny is in the Hugging Face cache here"),
        "{said}"
    );
    let down = suph::run_bounded(
        NetnsPair::wrap(Some(&pair.a), head.command(&["down"])),
        Duration::from_secs(60),
    );
    assert!(down.status.success(), "down: {}", text(&down));
}
