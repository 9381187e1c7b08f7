//! What another local user, or a topology written to harm, gets from pdctl on one machine
//! (docs/security.md): an ssh destination that is an option, a node name that is no DNS
//! label are refused at `plan` (exit 2, located); a state dir another user owns or may
//! write is refused; every file a running cluster keeps is its user's only; a journal
//! that cannot be read is moved aside and changes wait for the user's word; a join token
//! joins one node, once, in its time, a joined node holds no cluster secret, a node
//! that joins again leaves its old certificate refused, and a joined node renews its
//! certificate at the head's `up` (the old one refused by the head and the other nodes).

use crate::common;
use crate::common::netns;
use crate::common::supervisor as suph;

use common::TempDir;
use pdctl::control::tls::{JoinToken, NodeCreds, TLS_DIR};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;
use suph::{Cluster, sim_topology, text};

/// A two-node topology whose worker is `worker` (its key in `[nodes]` quoted) reached
/// over `ssh`.
fn two_nodes(worker: &str, ssh: &str) -> String {
    format!(
        "cluster = \"sec\"\nhead = \"head\"\n\
         [nodes]\nhead = \"127.0.0.1\"\n\"{worker}\" = {{ address = \"127.0.0.3\", ssh = \"{ssh}\" }}\n\
         [model]\nname = \"sim-model\"\n[engine]\nkind = \"sim\"\n\
         [connector]\nkind = \"nixl\"\n\
         [prefill]\ninstances = 1\nnode = \"head\"\n\
         [decode]\ninstances = 1\nnodes = [\"{worker}\"]\n"
    )
}

/// `pdctl ARGS -f FILE` of `topology` written into `dir`: exit code and what it said.
fn with_topology(c: &Cluster, dir: &Path, args: &[&str], topology: &str) -> (i32, String) {
    let file = dir.join("topology.toml");
    std::fs::write(&file, topology).unwrap();
    let mut all = args.to_vec();
    all.extend(["-f", file.to_str().unwrap()]);
    let out = c.run(&all);
    (out.status.code().unwrap_or(-1), text(&out))
}

#[test]
fn an_ssh_option_or_a_node_name_that_is_no_dns_label_is_refused_at_plan() {
    let c = Cluster::new("secplan");
    let dir = TempDir::new("secplan-topo");
    let marker = dir.path().join("ran");
    let proxy_command = format!("-oProxyCommand=touch {}", marker.display());
    let (code, said) = with_topology(
        &c,
        dir.path(),
        &["plan"],
        &two_nodes("worker", &proxy_command),
    );
    assert_eq!(code, 2, "{said}");
    assert!(
        said.contains("topology.toml:")
            && said.contains("nodes.worker.ssh")
            && said.contains("begins with `-`"),
        "{said}"
    );
    // `up` refuses it too, before any ssh runs.
    let (code, said) = with_topology(
        &c,
        dir.path(),
        &["up", "-d"],
        &two_nodes("worker", &proxy_command),
    );
    assert_eq!(code, 2, "{said}");
    assert!(!marker.exists(), "the ProxyCommand ran");

    let long = "w".repeat(200);
    for bad in [long.as_str(), "a/b"] {
        let (code, said) =
            with_topology(&c, dir.path(), &["plan"], &two_nodes(bad, "root@127.0.0.3"));
        assert_eq!(code, 2, "{bad}: {said}");
        assert!(
            said.contains("topology.toml:")
                && said.contains(&format!("nodes.{bad}"))
                && said.contains("DNS label")
                && said.contains("63 characters"),
            "{bad}: {said}"
        );
    }
    assert!(
        std::fs::read_dir(c.root())
            .unwrap()
            .flatten()
            .all(|e| e.path().extension().is_some_and(|x| x == "py")),
        "plan or a refused up left something in the state root"
    );
}

#[test]
fn a_state_dir_another_user_owns_or_may_write_is_refused() {
    let c = Cluster::new("secown");
    let dir = TempDir::new("secown-topo");
    let (topology, _) = sim_topology("secown", "example", 1, 1, "");
    let state = c.root().join("secown");
    std::fs::create_dir(&state).unwrap();
    let nobody = nix::unistd::User::from_name("nobody")
        .unwrap()
        .expect("this test needs the user `nobody`");
    nix::unistd::chown(&state, Some(nobody.uid), None)
        .expect("this test runs as root, to give a folder to `nobody`");
    let (code, said) = with_topology(&c, dir.path(), &["up", "-d"], &topology);
    assert_eq!(code, 2, "{said}");
    assert!(
        said.contains("not safe") && said.contains(&format!("owned by user {}", nobody.uid)),
        "{said}"
    );
    assert!(c.status(&[]).is_none(), "something runs: {said}");

    nix::unistd::chown(&state, Some(nix::unistd::geteuid()), None).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (code, said) = with_topology(&c, dir.path(), &["up", "-d"], &topology);
    assert_eq!(code, 2, "{said}");
    assert!(said.contains("group or others may write it"), "{said}");
}

#[test]
fn a_weak_cluster_secret_is_refused_before_anything_starts() {
    let c = Cluster::new("secweak");
    let dir = TempDir::new("secweak-topo");
    let (topology, _) = sim_topology("secweak", "example", 1, 1, "");
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, topology).unwrap();
    let f = file.to_str().unwrap();
    let weak_file = dir.path().join("weak.secret");
    std::fs::write(&weak_file, "correcthorsebattery\n").unwrap();
    let up = |env: Option<&str>, args: &[&str]| {
        let mut all = vec!["up", "-d", "-f", f];
        all.extend(args);
        let mut cmd = c.command(&all);
        match env {
            Some(v) => cmd.env(pdctl::control::auth::SECRET_ENV, v),
            None => cmd.env_remove(pdctl::control::auth::SECRET_ENV),
        };
        let out = suph::run_bounded(cmd, Duration::from_secs(60));
        (out.status.code().unwrap_or(-1), text(&out))
    };
    let (code, said) = up(Some("password1234"), &[]);
    assert_eq!(code, 2, "{said}");
    assert!(
        said.contains("in PDCTL_CLUSTER_SECRET")
            && said.contains("fewer than 128")
            && said.contains("openssl rand -hex 32"),
        "{said}"
    );
    let (code, said) = up(None, &["--secret-file", weak_file.to_str().unwrap()]);
    assert_eq!(code, 2, "{said}");
    assert!(
        said.contains(&format!("in {}", weak_file.display())) && said.contains("fewer than 128"),
        "{said}"
    );
    assert!(c.status(&[]).is_none(), "something runs: {said}");
    assert!(
        !c.root()
            .join("secweak")
            .join(pdctl::control::auth::SECRET_FILE)
            .exists(),
        "a weak secret was kept"
    );
}

#[test]
fn without_home_or_a_state_dir_pdctl_stops_rather_than_use_a_shared_folder() {
    let dir = TempDir::new("sechome-topo");
    let (topology, _) = sim_topology("sechome", "example", 1, 1, "");
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, topology).unwrap();
    for args in [
        vec!["up", "-d", "-f", file.to_str().unwrap()],
        vec!["status"],
    ] {
        let mut cmd = common::pdctl(&args);
        for var in ["HOME", "XDG_STATE_HOME", "PDCTL_STATE_DIR"] {
            cmd.env_remove(var);
        }
        let out = suph::run_bounded(cmd, Duration::from_secs(60));
        let said = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(
            said.contains("no state directory: HOME is not set")
                && said.contains("--state-dir DIR"),
            "{args:?}: {said}"
        );
    }
    // Where pdctl before issue 45 put it: a folder every local user may reach.
    for shared in [std::env::temp_dir(), "/tmp".into()] {
        let fallback = shared.join(".local/state/pdctl/sechome");
        assert!(!fallback.exists(), "{} was made", fallback.display());
    }
}

/// Every file and folder under `dir`: its path and mode bits.
fn modes(dir: &Path, out: &mut Vec<(String, u32)>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let meta = std::fs::symlink_metadata(e.path()).unwrap();
        out.push((
            e.path().display().to_string(),
            meta.permissions().mode() & 0o777,
        ));
        if meta.is_dir() {
            modes(&e.path(), out);
        }
    }
}

#[test]
fn every_file_of_a_running_cluster_is_its_users_only() {
    let c = Cluster::new("secmode");
    let dir = TempDir::new("secmode-topo");
    let (topology, _) = sim_topology("secmode", "example", 1, 1, "");
    // A state dir an older pdctl left readable by others is made private.
    let state = c.root().join("secmode");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(state.join("plan.json"), "{}").unwrap();
    std::fs::set_permissions(
        state.join("plan.json"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    c.up_topology(dir.path(), &topology);
    let mut all = vec![(
        state.display().to_string(),
        std::fs::metadata(&state).unwrap().permissions().mode() & 0o777,
    )];
    modes(&state, &mut all);
    let down = c.run(&["down"]);
    assert!(down.status.success(), "down: {}", text(&down));
    assert!(all.len() > 5, "{all:?}");
    let open: Vec<_> = all
        .iter()
        .filter(|(_, m)| *m != 0o600 && *m != 0o700)
        .collect();
    assert!(open.is_empty(), "not 0600 or 0700: {open:?}");
}

#[test]
fn a_truncated_journal_is_moved_aside_and_changes_wait_for_the_users_word() {
    let c = Cluster::new("secjour");
    let dir = TempDir::new("secjour-topo");
    let (topology, _) = sim_topology("secjour", "example", 1, 1, "");
    c.up_topology(dir.path(), &topology);
    let state = pdctl::supervisor::StateDir::new(c.root().join("secjour"));
    suph::kill_supervisor_and_wait(&state);
    let truncated = r#"{"what": "scale decode=2", "started_ms": 1, "kind": {"change": "pla"#;
    std::fs::write(state.journal_path(), truncated).unwrap();
    c.up_topology(dir.path(), &topology);

    // `status` says what happened.
    let r = c.wait_status(std::time::Duration::from_secs(30), &[], |r| {
        r.operation.as_ref().is_some_and(|o| o.outcome.is_some())
    });
    let line = r
        .operation
        .as_ref()
        .map(|o| o.line(pdctl::control::operation::now_ms()))
        .unwrap_or_default();
    assert!(
        line.contains("could not be read")
            && line.contains("journal.json.bad-")
            && line.contains("reconciled")
            && line.contains("pdctl ack-journal"),
        "{line}"
    );
    let shown = c.run(&["status"]);
    assert!(
        text(&shown).contains("journal.json.bad-"),
        "{}",
        text(&shown)
    );
    // Kept as it was, for the user to read; no journal.json left to overwrite unseen.
    let aside: Vec<_> = std::fs::read_dir(&state.dir)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("journal.json.bad-")
        })
        .collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(std::fs::read_to_string(aside[0].path()).unwrap(), truncated);
    assert!(!state.journal_path().exists());

    // Changes are refused until the user acknowledges it.
    let refused = c.run(&["scale", "decode=2"]);
    assert!(!refused.status.success(), "{}", text(&refused));
    assert!(
        text(&refused).contains("pdctl ack-journal"),
        "{}",
        text(&refused)
    );
    let ack = c.run(&["ack-journal"]);
    assert!(ack.status.success(), "{}", text(&ack));
    let scaled = c.run(&["scale", "decode=2"]);
    assert!(scaled.status.success(), "{}", text(&scaled));
    let r = c.status(&[]).expect("the cluster runs");
    assert!(r.services.iter().any(|s| s.name == "decode-1"), "{r:?}");
    let down = c.run(&["down"]);
    assert!(down.status.success(), "down: {}", text(&down));
}

#[test]
fn with_a_client_key_a_proxy_where_the_head_cannot_hand_it_is_refused_at_plan() {
    let c = Cluster::new("seckey");
    let dir = TempDir::new("seckey-topo");
    let by_hand = "cluster = \"sec\"\nhead = \"head\"\n\
         [nodes]\nhead = \"127.0.0.1\"\nworker = \"127.0.0.3\"\n\
         [model]\nname = \"sim-model\"\n[engine]\nkind = \"sim\"\n\
         [connector]\nkind = \"nixl\"\n\
         [prefill]\ninstances = 1\nnode = \"head\"\n\
         [decode]\ninstances = 1\nnodes = [\"worker\"]\n\
         [proxy]\nnode = \"worker\"\n";
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, by_hand).unwrap();
    let plan = |key: Option<&str>| {
        let mut cmd = c.command(&["plan", "-f", file.to_str().unwrap()]);
        match key {
            Some(k) => cmd.env("PDCTL_API_KEY", k),
            None => cmd.env_remove("PDCTL_API_KEY"),
        };
        let out = suph::run_bounded(cmd, std::time::Duration::from_secs(60));
        (out.status.code().unwrap_or(-1), text(&out))
    };
    let (code, said) = plan(Some("a-client-key"));
    assert_eq!(code, 2, "{said}");
    assert!(
        said.contains("topology.toml:") && said.contains("proxy.node") && said.contains("ssh"),
        "{said}"
    );
    // Without a client key there is nothing to hand.
    let (code, said) = plan(None);
    assert_eq!(code, 0, "{said}");
    // On a node the head starts over ssh, it is handed in the node's bundle.
    let over_ssh = by_hand.replace(
        "worker = \"127.0.0.3\"",
        "worker = { address = \"127.0.0.3\", ssh = \"root@127.0.0.3\" }",
    );
    std::fs::write(&file, over_ssh).unwrap();
    let (code, said) = plan(Some("a-client-key"));
    assert_eq!(code, 0, "{said}");
}

/// One status request over the channel as `creds.node` to node `server` at `addr`, from
/// `ns`: the answer, or what the connection ended with.
fn ask_as(
    ns: Option<&str>,
    creds: pdctl::control::tls::NodeCreds,
    addr: String,
    server: &'static str,
) -> String {
    netns::in_netns(ns, move || {
        let nodes = ["head", "worker", "other"].map(String::from).to_vec();
        let tls = pdctl::control::tls::PeerTls::new("sectok", "head", nodes, &creds, None).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = match pdctl::control::client::open_peer(&addr, server, &tls).await {
                Ok(s) => s,
                Err(e) => return format!("handshake: {e}"),
            };
            if let Err(e) = s.write_all(b"{\"cmd\":\"status\"}\n").await {
                return format!("write: {e}");
            }
            let _ = s.flush().await;
            let mut answer = vec![0u8; 1 << 16];
            match tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut answer))
                .await
            {
                Ok(Ok(n)) => String::from_utf8_lossy(&answer[..n]).into_owned(),
                Ok(Err(e)) => format!("read: {e}"),
                Err(_) => "no answer".into(),
            }
        })
    })
}

/// Whether an answer of [`ask_as`] is a status report (the certificate was taken).
fn taken(answer: &str) -> bool {
    answer.contains(r#""reply":"status""#)
}

/// A cluster `sectok` over two hosts: the head (with the CA) on one, `worker` started by
/// hand on the other, and `other`, a node that never runs (127.0.0.9).
struct JoinPair {
    hosts: netns::TwoHosts,
    head: Cluster,
    worker: Cluster,
    _dir: TempDir,
    file: String,
    /// `address:port` of the head's and the worker's control channel.
    head_control: String,
    worker_control: String,
}

impl JoinPair {
    fn new(tag: &str) -> JoinPair {
        let hosts = netns::TwoHosts::make(tag);
        let run = suph::free_port_run(12);
        let topology = format!(
            "cluster = \"sectok\"\nhead = \"head\"\n\
             [nodes]\nhead = \"{}\"\nworker = \"{}\"\nother = \"127.0.0.9\"\n\
             [model]\nname = \"sim-model\"\n[engine]\nkind = \"sim\"\n\
             [connector]\nkind = \"nixl\"\n\
             [prefill]\ninstances = 1\nnode = \"head\"\nbase_port = {}\n\
             [decode]\ninstances = 1\nnodes = [\"worker\"]\nbase_port = {}\n\
             [control]\nport = {}\n\
             [proxy]\nport = {run}\n",
            hosts.addr_a,
            hosts.addr_b,
            run + 2,
            run + 6,
            run + 11,
        );
        let dir = TempDir::new(&format!("{tag}-topo"));
        let file = dir.path().join("topology.toml");
        std::fs::write(&file, &topology).unwrap();
        JoinPair {
            head_control: format!("{}:{}", hosts.addr_a, run + 11),
            worker_control: format!("{}:{}", hosts.addr_b, run + 11),
            hosts,
            head: Cluster::new(&format!("{tag}head")),
            worker: Cluster::new(&format!("{tag}work")),
            _dir: dir,
            file: file.to_str().unwrap().to_string(),
        }
    }

    fn ns_head(&self) -> Option<&str> {
        self.hosts.ns_a.as_deref()
    }

    fn ns_worker(&self) -> Option<&str> {
        self.hosts.ns_b.as_deref()
    }

    /// `pdctl ARGS` on the head's host.
    fn on_head(&self, args: &[&str]) -> std::process::Command {
        netns::NetnsPair::wrap(self.ns_head(), self.head.command(args))
    }

    /// `pdctl ARGS` on the worker's host.
    fn on_worker(&self, args: &[&str]) -> std::process::Command {
        netns::NetnsPair::wrap(self.ns_worker(), self.worker.command(args))
    }

    /// `pdctl up -d --node head` started (it waits for the worker).
    fn start_head(&self) -> std::process::Child {
        self.on_head(&["up", "-d", "-f", &self.file, "--node", "head"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// `pdctl up -d --node worker`, with `token` when given; panics when it fails.
    fn up_worker(&self, token: Option<&str>) {
        let mut up = self.on_worker(&["up", "-d", "-f", &self.file, "--node", "worker"]);
        if let Some(t) = token {
            up.env(pdctl::control::auth::JOIN_TOKEN_ENV, t);
        }
        let out = suph::run_bounded(up, Duration::from_secs(90));
        assert!(out.status.success(), "worker: {}", text(&out));
    }

    /// A join token for `node` good for `ttl`, made on the head once its supervisor runs.
    fn token_for(&self, node: &str, ttl: &str) -> String {
        let mut token = None;
        let made = common::wait_until(Duration::from_secs(30), || {
            let out = suph::run_bounded(
                self.on_head(&["join-token", "--node", node, "--ttl", ttl]),
                Duration::from_secs(30),
            );
            token = out
                .status
                .success()
                .then(|| String::from_utf8(out.stdout).unwrap().trim().to_string());
            token.is_some()
        });
        assert!(made, "the head made no join token");
        token.unwrap()
    }

    /// A join with `token` as `node` from the worker's host: the credentials the head
    /// issued, or why not.
    /// `pdctl join-token` reads the head's files, so it answers before the head's
    /// supervisor listens on its control channel (`up` on a node retries for that, a bare
    /// join does not): the join waits for the listener first.
    fn join(&self, token: &str, node: &'static str) -> Result<NodeCreds, String> {
        let (to, token) = (self.head_control.clone(), JoinToken::parse(token).unwrap());
        netns::in_netns(self.ns_worker(), move || {
            let listens = common::wait_until(Duration::from_secs(30), || {
                std::net::TcpStream::connect(&to).is_ok()
            });
            assert!(listens, "the head's control channel at {to} never listened");
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(pdctl::control::client::join(
                &to,
                "head",
                node,
                &token,
                Duration::from_secs(10),
            ))
            .map(|j| j.creds)
            .map_err(|e| e.to_string())
        })
    }

    /// A status request to the head as `creds.node`, from the worker's host.
    fn ask_head(&self, creds: &NodeCreds) -> String {
        ask_as(
            self.ns_worker(),
            creds.clone(),
            self.head_control.clone(),
            "head",
        )
    }

    /// A status request to the worker as `creds.node`, from the head's host.
    fn ask_worker(&self, creds: &NodeCreds) -> String {
        ask_as(
            self.ns_head(),
            creds.clone(),
            self.worker_control.clone(),
            "worker",
        )
    }

    /// The head's state dir and the worker's.
    fn head_state(&self) -> std::path::PathBuf {
        self.head.root().join("sectok-head")
    }

    fn worker_state(&self) -> std::path::PathBuf {
        self.worker.root().join("sectok-worker")
    }

    /// The credentials the worker keeps.
    fn worker_creds(&self) -> NodeCreds {
        NodeCreds::read(&self.worker_state().join(TLS_DIR))
            .unwrap()
            .expect("the worker's certificate")
    }

    /// The credentials the head keeps of its own.
    fn head_creds(&self) -> NodeCreds {
        NodeCreds::read(&self.head_state().join(TLS_DIR))
            .unwrap()
            .expect("the head's certificate")
    }

    /// The head's `up` again, its supervisor killed first (the worker still running),
    /// with `env` set for it and the supervisor it starts.
    fn up_head_again(&self, env: &[(&str, &str)]) {
        let state = pdctl::supervisor::StateDir::new(self.head_state());
        suph::kill_supervisor_and_wait(&state);
        let mut up = self.on_head(&["up", "-d", "-f", &self.file, "--node", "head"]);
        for (k, v) in env {
            up.env(k, v);
        }
        let up = suph::run_bounded(up, Duration::from_secs(90));
        assert!(up.status.success(), "head up again: {}", text(&up));
    }

    /// Waits until every service of the cluster is healthy, as the head reports them.
    fn wait_healthy(&self) {
        let r = self
            .head
            .wait_status(Duration::from_secs(60), &[], suph::all_healthy);
        assert!(suph::all_healthy(&r), "{r:?}");
    }

    /// What both supervisors logged of renewals, with the time of each line: how a failed
    /// wait for one shows where it went.
    fn renewal_log(&self) -> String {
        let lines = |dir: std::path::PathBuf| {
            let log = pdctl::supervisor::StateDir::new(dir).supervisor_log_path();
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let picked: Vec<&str> = text
                .lines()
                .filter(|l| l.contains("renew") || l.contains("answer"))
                .collect();
            picked.join("\n")
        };
        format!(
            "head:\n{}\nworker:\n{}",
            lines(self.head_state()),
            lines(self.worker_state())
        )
    }

    /// The head's book of certificates and tokens.
    fn book(&self) -> pdctl::control::tls::Book {
        pdctl::control::tls::Book::read(&self.head_state().join(TLS_DIR)).unwrap()
    }

    /// Takes the worker down, then the head.
    fn down(&self) {
        let down = suph::run_bounded(self.on_worker(&["down"]), Duration::from_secs(60));
        assert!(down.status.success(), "worker down: {}", text(&down));
        let down = suph::run_bounded(self.on_head(&["down"]), Duration::from_secs(90));
        assert!(down.status.success(), "head down: {}", text(&down));
    }
}

#[test]
fn a_join_token_joins_one_node_once_in_its_time_and_the_secret_stays_on_the_head() {
    let c = JoinPair::new("pdj");
    let up_head = c.start_head();

    // A token made for the worker cannot join another node; an expired one nothing.
    let token = c.token_for("worker", "1h");
    let err = c
        .join(&token, "other")
        .expect_err("a token for worker joined as other");
    assert!(err.contains("made for node worker, not other"), "{err}");
    let short = c.token_for("worker", "1s");
    std::thread::sleep(Duration::from_secs(2));
    let err = c
        .join(&short, "worker")
        .expect_err("an expired token joined");
    assert!(err.contains("expired"), "{err}");

    // The worker joins with it, once.
    c.up_worker(Some(&token));
    let up = up_head.wait_with_output().unwrap();
    assert!(up.status.success(), "head: {}", text(&up));
    let r = c
        .head
        .wait_status(Duration::from_secs(60), &[], suph::all_healthy);
    assert!(suph::all_healthy(&r), "{r:?}");
    let err = c.join(&token, "worker").expect_err("a token joined twice");
    assert!(err.contains("used already"), "{err}");

    // The cluster's secret stayed on the head: the worker has its certificate, key and
    // the engines' key, no secret.
    let state = c.worker_state();
    assert!(!state.join(pdctl::control::auth::SECRET_FILE).exists());
    let mut held = Vec::new();
    modes(&state, &mut held);
    let head_secret = std::fs::read_to_string(c.head_state().join("cluster.secret")).unwrap();
    for (path, _) in &held {
        let bytes = std::fs::read(path).unwrap_or_default();
        assert!(
            !bytes
                .windows(head_secret.trim().len())
                .any(|w| w == head_secret.trim().as_bytes()),
            "the cluster secret is in {path}"
        );
    }
    let said = suph::run_bounded(c.on_worker(&["secret"]), Duration::from_secs(30));
    assert_eq!(said.status.code(), Some(2), "{}", text(&said));
    assert!(text(&said).contains("lives on the head"), "{}", text(&said));
    let key = suph::run_bounded(
        c.on_worker(&["secret", "--engine-key"]),
        Duration::from_secs(30),
    );
    assert!(key.status.success(), "{}", text(&key));
    assert_eq!(
        String::from_utf8_lossy(&key.stdout).trim(),
        c.head.engine_key()
    );

    // Joining again revokes the certificate before.
    let old = c.worker_creds();
    let before = c.ask_head(&old);
    assert!(taken(&before), "{before}");
    let again = c
        .join(&c.token_for("worker", "1h"), "worker")
        .expect("a new token joins");
    let refused = c.ask_head(&old);
    assert!(!taken(&refused), "the old certificate was taken: {refused}");
    let now = c.ask_head(&again);
    assert!(taken(&now), "{now}");
    // `--revoke NODE` shuts that node's certificate out.
    let revoke = suph::run_bounded(
        c.on_head(&["join-token", "--revoke", "worker"]),
        Duration::from_secs(30),
    );
    assert!(revoke.status.success(), "{}", text(&revoke));
    let shut = c.ask_head(&again);
    assert!(!taken(&shut), "a revoked certificate was taken: {shut}");

    let list = suph::run_bounded(
        c.on_head(&["join-token", "--list"]),
        Duration::from_secs(30),
    );
    let listed = text(&list);
    assert!(list.status.success(), "{listed}");
    assert!(
        listed.contains("used") && listed.contains("expired"),
        "{listed}"
    );
    assert!(
        !listed.contains(&token[token.len() - 64..]),
        "--list shows a token's secret"
    );
    c.down();
}

#[test]
fn a_joined_node_renews_its_certificate_at_the_heads_up_and_every_node_refuses_a_replaced_one() {
    let c = JoinPair::new("pdr");
    let up_head = c.start_head();
    c.up_worker(Some(&c.token_for("worker", "1h")));
    let up = up_head.wait_with_output().unwrap();
    assert!(up.status.success(), "head: {}", text(&up));
    let r = c
        .head
        .wait_status(Duration::from_secs(60), &[], suph::all_healthy);
    assert!(suph::all_healthy(&r), "{r:?}");
    let old = c.worker_creds();
    let old_issued = c.book().issued["worker"].clone();
    assert_eq!(old_issued.how, "join");

    // The worker takes the head's word on which certificate of a node is the one: a
    // certificate of `other` that a second join replaced is refused by the worker too.
    let first = c
        .join(&c.token_for("other", "1h"), "other")
        .expect("other joins");
    let took_first = common::wait_until(Duration::from_secs(15), || taken(&c.ask_worker(&first)));
    assert!(took_first, "the worker refused other's current certificate");
    let second = c
        .join(&c.token_for("other", "1h"), "other")
        .expect("other joins again");
    let refused = common::wait_until(Duration::from_secs(15), || !taken(&c.ask_worker(&first)));
    assert!(
        refused,
        "the worker still takes other's replaced certificate"
    );
    let now = c.ask_worker(&second);
    assert!(taken(&now), "{now}");

    // The head's `up` again (its supervisor gone, the worker still running): the worker
    // renews its certificate over the channel, on its own.
    let state = pdctl::supervisor::StateDir::new(c.head_state());
    suph::kill_supervisor_and_wait(&state);
    let up = suph::run_bounded(
        c.on_head(&["up", "-d", "-f", &c.file, "--node", "head"]),
        Duration::from_secs(90),
    );
    assert!(up.status.success(), "head up again: {}", text(&up));
    let up_returned = std::time::Instant::now();
    // (Its files are written one after another: wait for both.)
    let renewed = common::wait_until(Duration::from_secs(30), || {
        let now = c.worker_creds();
        now.cert_pem != old.cert_pem && now.key_pem != old.key_pem
    });
    assert!(
        renewed,
        "the worker kept its certificate after the head's up"
    );
    eprintln!(
        "the worker renewed its certificate {:.1} s after the head's up returned",
        up_returned.elapsed().as_secs_f64()
    );
    let new = c.worker_creds();
    // Two-phase: the head drops the old certificate once the worker used the new one
    // (its next poll opens a connection with it).
    let confirmed = common::wait_until(Duration::from_secs(10), || {
        c.book().issued["worker"].how == "renew"
    });
    assert!(
        confirmed,
        "the head still waits for the renewed certificate's first use"
    );
    let issued = c.book().issued["worker"].clone();
    assert_eq!(issued.how, "renew");
    assert_ne!(issued.serial, old_issued.serial);
    assert!(issued.not_after_s > old_issued.not_after_s, "{issued:?}");
    let der = |pem: &str| {
        use rustls::pki_types::pem::PemObject;
        rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    };
    assert_eq!(
        issued.sha256,
        pdctl::control::tls::cert_hash(&der(&new.cert_pem)),
        "the worker keeps the certificate the head accepts"
    );
    assert_ne!(new.key_pem, old.key_pem, "a new key");
    assert_eq!(new.node, "worker");
    let mut kept = Vec::new();
    modes(&c.worker_state().join(TLS_DIR), &mut kept);
    assert!(
        kept.iter().all(|(_, m)| *m == 0o600 || *m == 0o700),
        "{kept:?}"
    );
    let now = c.ask_head(&new);
    assert!(
        taken(&now),
        "the head refused the renewed certificate: {now}"
    );
    let refused = c.ask_head(&old);
    assert!(
        !taken(&refused),
        "the head took the old certificate: {refused}"
    );
    // Renewed once, not at every poll; the cluster stays whole.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(c.book().issued["worker"], issued);
    let r = c
        .head
        .wait_status(Duration::from_secs(60), &[], suph::all_healthy);
    assert!(suph::all_healthy(&r), "{r:?}");
    let list = suph::run_bounded(
        c.on_head(&["join-token", "--list"]),
        Duration::from_secs(30),
    );
    let listed = text(&list);
    assert!(
        listed.contains(&format!("worker  serial {}  from renew", issued.serial)),
        "{listed}"
    );
    c.down();
}

/// Holds a connection to the head as `creds.node` from the worker's host: answers one
/// status request, says so on `ready`, waits for `go`, then reads until the head closes
/// the connection. How long after `go` it was closed (None: not within 10 s).
fn held_connection(
    c: &JoinPair,
    creds: NodeCreds,
    ready: std::sync::mpsc::Sender<String>,
    go: std::sync::mpsc::Receiver<()>,
) -> std::thread::JoinHandle<Option<Duration>> {
    let ns = c.ns_worker().map(|n| format!("/var/run/netns/{n}"));
    let addr = c.head_control.clone();
    std::thread::spawn(move || {
        netns::enter(ns.as_deref());
        let nodes = ["head", "worker", "other"].map(String::from).to_vec();
        let tls = pdctl::control::tls::PeerTls::new("sectok", "head", nodes, &creds, None).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = pdctl::control::client::open_peer(&addr, "head", &tls)
                .await
                .expect("the current certificate connects");
            s.write_all(b"{\"cmd\":\"status\"}\n").await.unwrap();
            let mut answer = vec![0u8; 1 << 16];
            let n = s.read(&mut answer).await.unwrap();
            let _ = ready.send(String::from_utf8_lossy(&answer[..n]).into_owned());
            go.recv().unwrap();
            let asked = std::time::Instant::now();
            let closed = tokio::time::timeout(Duration::from_secs(10), async {
                loop {
                    match s.read(&mut answer).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                }
            });
            closed.await.ok().map(|()| asked.elapsed())
        })
    })
}

#[test]
fn a_revoked_node_that_is_still_connected_is_cut_off_within_a_second() {
    let c = JoinPair::new("pdv");
    let up_head = c.start_head();
    c.up_worker(Some(&c.token_for("worker", "1h")));
    let up = up_head.wait_with_output().unwrap();
    assert!(up.status.success(), "head: {}", text(&up));
    let other = c
        .join(&c.token_for("other", "1h"), "other")
        .expect("other joins");

    // A connection `other` keeps open (as a node keeps one for its polls) is closed
    // within a second of `--revoke other`, though it sends nothing more.
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel();
    let held = held_connection(&c, other.clone(), ready_tx, go_rx);
    let first = ready.recv_timeout(Duration::from_secs(20)).unwrap();
    assert!(taken(&first), "{first}");
    let revoke = suph::run_bounded(
        c.on_head(&["join-token", "--revoke", "other"]),
        Duration::from_secs(30),
    );
    assert!(revoke.status.success(), "{}", text(&revoke));
    go.send(()).unwrap();
    let closed = held.join().unwrap();
    assert!(
        closed.is_some_and(|t| t <= Duration::from_secs(1)),
        "the revoked node's connection was closed after {closed:?}"
    );
    let again = c.ask_head(&other);
    assert!(!taken(&again), "a revoked certificate was taken: {again}");
    c.down();
}

/// A joined cluster of the head and the worker, every service healthy.
fn joined(tag: &str) -> JoinPair {
    let c = JoinPair::new(tag);
    let up_head = c.start_head();
    c.up_worker(Some(&c.token_for("worker", "1h")));
    let up = up_head.wait_with_output().unwrap();
    assert!(up.status.success(), "head: {}", text(&up));
    c.wait_healthy();
    c
}

#[test]
fn a_worker_refuses_the_heads_old_certificate_once_a_rotation_the_old_one_signed_is_in_use() {
    let c = joined("pdh");
    let old = c.head_creds();
    assert_eq!(
        c.worker_creds().head_pem.as_deref(),
        Some(old.cert_pem.as_str()),
        "the worker learned the head's certificate at its join"
    );
    let before = c.ask_worker(&old);
    assert!(taken(&before), "{before}");

    // Staged on the head, announced in its status answers, taken by the worker.
    let rotate = suph::run_bounded(
        c.on_head(&["join-token", "--rotate-head"]),
        Duration::from_secs(30),
    );
    assert!(rotate.status.success(), "{}", text(&rotate));
    assert!(text(&rotate).contains("staged"), "{}", text(&rotate));
    let next = c.worker_state().join(TLS_DIR).join("head-next.pem");
    let took = common::wait_until(Duration::from_secs(15), || next.exists());
    assert!(
        took,
        "the worker did not take the head's announced rotation"
    );
    let still = c.ask_worker(&old);
    assert!(
        taken(&still),
        "the old one until the head's next up: {still}"
    );

    // The head's next `up` puts it to use: the worker follows, and refuses the old one.
    c.up_head_again(&[]);
    let new = c.head_creds();
    assert_ne!(new.cert_pem, old.cert_pem);
    assert_ne!(new.key_pem, old.key_pem);
    let switched = common::wait_until(Duration::from_secs(30), || {
        c.worker_creds().head_pem.as_deref() == Some(new.cert_pem.as_str())
    });
    assert!(switched, "the worker kept the head's old certificate");
    assert!(!next.exists());
    let refused = c.ask_worker(&old);
    assert!(
        !taken(&refused),
        "the worker took the head's old certificate: {refused}"
    );
    let now = c.ask_worker(&new);
    assert!(taken(&now), "{now}");
    c.wait_healthy();
    c.down();
}

#[test]
fn a_renewal_whose_answer_is_lost_is_asked_again_and_the_node_stays_in_the_cluster() {
    let c = joined("pdl");
    let old = c.worker_creds();
    // The head's `up` again marks the worker for renewal; its first answer is lost (the
    // head records it, then closes the connection unanswered: a debug build's test hook,
    // `PDCTL_TEST_LOSE_RENEWAL_ANSWERS`).
    c.up_head_again(&[("PDCTL_TEST_LOSE_RENEWAL_ANSWERS", "1")]);
    let answered = common::wait_until(Duration::from_secs(30), || {
        c.book().issued["worker"].pending.is_some()
    });
    assert!(
        answered,
        "the head answered no renewal:\n{}",
        c.renewal_log()
    );
    let lost_at = std::time::Instant::now();
    let pending = c.book().issued["worker"].pending.clone().unwrap();
    // A lost answer, not a slow one: nothing installed, nothing confirmed, seconds later
    // (an answer that arrives is installed and used within a second).
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        c.worker_creds(),
        old,
        "the answer was lost: nothing installed"
    );
    assert_eq!(c.book().issued["worker"].pending.as_ref(), Some(&pending));
    let kept = c.ask_head(&old);
    assert!(
        taken(&kept),
        "the head refused the certificate it still holds: {kept}"
    );
    c.wait_healthy();

    // Its next try (60 s later) is sent the same certificate and uses it.
    let renewed = common::wait_until(Duration::from_secs(150), || {
        c.book().issued["worker"].how == "renew"
    });
    assert!(renewed, "the worker never renewed after the lost answer");
    eprintln!(
        "the worker renewed {:.1} s after its first answer was lost\n{}",
        lost_at.elapsed().as_secs_f64(),
        c.renewal_log()
    );
    let issued = c.book().issued["worker"].clone();
    assert_eq!(
        issued.sha256, pending.sha256,
        "the same answer, asked again"
    );
    let der = |pem: &str| {
        use rustls::pki_types::pem::PemObject;
        rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    };
    assert_eq!(
        pdctl::control::tls::cert_hash(&der(&c.worker_creds().cert_pem)),
        issued.sha256
    );
    let refused = c.ask_head(&old);
    assert!(!taken(&refused), "the old certificate after: {refused}");
    c.wait_healthy();
    c.down();
}
