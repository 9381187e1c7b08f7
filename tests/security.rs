//! What another local user, or a topology written to harm, gets from pdctl on one machine
//! (docs/security.md): an ssh destination that is an option, a node name that is no DNS
//! label are refused at `plan` (exit 2, located); a state dir another user owns or may
//! write is refused; every file a running cluster keeps is its user's only; a journal
//! that cannot be read is moved aside and changes wait for the user's word; a join token
//! joins one node, once, in its time, a joined node holds no cluster secret, and a node
//! that joins again leaves its old certificate refused.

use crate::common;
use crate::common::netns;
use crate::common::supervisor as suph;

use common::TempDir;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
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

/// One request over the channel as `creds.node` to the head at `addr`, from `ns`: the
/// answer, or what the connection ended with.
fn ask_head_as(ns: Option<&str>, creds: pdctl::control::tls::NodeCreds, addr: String) -> String {
    netns::in_netns(ns, move || {
        let nodes = ["head", "worker", "other"].map(String::from).to_vec();
        let tls = pdctl::control::tls::PeerTls::new("sectok", "head", nodes, &creds, None).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = match pdctl::control::client::open_peer(&addr, "head", &tls).await {
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

#[test]
fn a_join_token_joins_one_node_once_in_its_time_and_the_secret_stays_on_the_head() {
    use pdctl::control::tls::{JoinToken, NodeCreds, TLS_DIR};
    use std::process::Stdio;
    use std::time::Duration;
    let netns::TwoHosts {
        pair: _pair,
        ns_a: ns_head,
        ns_b: ns_worker,
        addr_a: head_addr,
        addr_b: worker_addr,
    } = netns::TwoHosts::make("pdj");
    let (nh, nw) = (ns_head.as_deref(), ns_worker.as_deref());
    let run = suph::free_port_run(12);
    let topology = format!(
        "cluster = \"sectok\"\nhead = \"head\"\n\
         [nodes]\nhead = \"{head_addr}\"\nworker = \"{worker_addr}\"\nother = \"127.0.0.9\"\n\
         [model]\nname = \"sim-model\"\n[engine]\nkind = \"sim\"\n\
         [connector]\nkind = \"nixl\"\n\
         [prefill]\ninstances = 1\nnode = \"head\"\nbase_port = {}\n\
         [decode]\ninstances = 1\nnodes = [\"worker\"]\nbase_port = {}\n\
         [control]\nport = {}\n\
         [proxy]\nport = {run}\n",
        run + 2,
        run + 6,
        run + 11,
    );
    let (head, worker) = (Cluster::new("sjhead"), Cluster::new("sjwork"));
    let dir = TempDir::new("sectok-topo");
    let file = dir.path().join("topology.toml");
    std::fs::write(&file, &topology).unwrap();
    let f = file.to_str().unwrap();
    let on =
        |ns: Option<&str>, c: &Cluster, args: &[&str]| netns::NetnsPair::wrap(ns, c.command(args));
    let up_head = on(nh, &head, &["up", "-d", "-f", f, "--node", "head"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let token_for = |node: &str, ttl: &str| {
        let mut token = None;
        let made = common::wait_until(Duration::from_secs(30), || {
            let out = suph::run_bounded(
                on(nh, &head, &["join-token", "--node", node, "--ttl", ttl]),
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
    };
    let control = format!("{head_addr}:{}", run + 11);
    let join = |token: &str, node: &'static str| {
        let (to, token) = (control.clone(), JoinToken::parse(token).unwrap());
        netns::in_netns(nw, move || {
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
    };

    // A token made for the worker cannot join another node; an expired one nothing.
    let token = token_for("worker", "1h");
    let err = join(&token, "other").expect_err("a token for worker joined as other");
    assert!(err.contains("made for node worker, not other"), "{err}");
    let short = token_for("worker", "1s");
    std::thread::sleep(Duration::from_secs(2));
    let err = join(&short, "worker").expect_err("an expired token joined");
    assert!(err.contains("expired"), "{err}");

    // The worker joins with it, once.
    let mut up_worker = on(nw, &worker, &["up", "-d", "-f", f, "--node", "worker"]);
    up_worker.env(pdctl::control::auth::JOIN_TOKEN_ENV, &token);
    let out = suph::run_bounded(up_worker, Duration::from_secs(90));
    assert!(out.status.success(), "worker: {}", text(&out));
    let up = up_head.wait_with_output().unwrap();
    assert!(up.status.success(), "head: {}", text(&up));
    let r = head.wait_status(Duration::from_secs(60), &[], suph::all_healthy);
    assert!(suph::all_healthy(&r), "{r:?}");
    let err = join(&token, "worker").expect_err("a token joined twice");
    assert!(err.contains("used already"), "{err}");

    // The cluster's secret stayed on the head: the worker has its certificate, key and
    // the engines' key, no secret.
    let state = worker.root().join("sectok-worker");
    assert!(!state.join(pdctl::control::auth::SECRET_FILE).exists());
    let mut held = Vec::new();
    modes(&state, &mut held);
    let head_secret =
        std::fs::read_to_string(head.root().join("sectok-head").join("cluster.secret")).unwrap();
    for (path, _) in &held {
        let bytes = std::fs::read(path).unwrap_or_default();
        assert!(
            !bytes
                .windows(head_secret.trim().len())
                .any(|w| w == head_secret.trim().as_bytes()),
            "the cluster secret is in {path}"
        );
    }
    let said = suph::run_bounded(on(nw, &worker, &["secret"]), Duration::from_secs(30));
    assert_eq!(said.status.code(), Some(2), "{}", text(&said));
    assert!(text(&said).contains("lives on the head"), "{}", text(&said));
    let key = suph::run_bounded(
        on(nw, &worker, &["secret", "--engine-key"]),
        Duration::from_secs(30),
    );
    assert!(key.status.success(), "{}", text(&key));
    assert_eq!(
        String::from_utf8_lossy(&key.stdout).trim(),
        head.engine_key()
    );

    // Joining again revokes the certificate before.
    let old = NodeCreds::read(&state.join(TLS_DIR))
        .unwrap()
        .expect("the worker's certificate");
    let before = ask_head_as(nw, old.clone(), control.clone());
    assert!(before.contains(r#""reply":"status""#), "{before}");
    let again = join(&token_for("worker", "1h"), "worker").expect("a new token joins");
    let refused = ask_head_as(nw, old, control.clone());
    assert!(
        !refused.contains(r#""reply":"status""#),
        "the old certificate was taken: {refused}"
    );
    let taken = ask_head_as(nw, again.clone(), control.clone());
    assert!(taken.contains(r#""reply":"status""#), "{taken}");
    // `--revoke NODE` shuts that node's certificate out.
    let revoke = suph::run_bounded(
        on(nh, &head, &["join-token", "--revoke", "worker"]),
        Duration::from_secs(30),
    );
    assert!(revoke.status.success(), "{}", text(&revoke));
    let shut = ask_head_as(nw, again, control.clone());
    assert!(
        !shut.contains(r#""reply":"status""#),
        "a revoked certificate was taken: {shut}"
    );

    let list = suph::run_bounded(
        on(nh, &head, &["join-token", "--list"]),
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
    let down = suph::run_bounded(on(nw, &worker, &["down"]), Duration::from_secs(60));
    assert!(down.status.success(), "worker down: {}", text(&down));
    let down = suph::run_bounded(on(nh, &head, &["down"]), Duration::from_secs(90));
    assert!(down.status.success(), "head down: {}", text(&down));
}
