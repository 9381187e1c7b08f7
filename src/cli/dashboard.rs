//! The dashboard on the command line: started beside the head's supervisor (`up`,
//! `supervise`), its address in what `up` and `status` print, `pdctl dashboard` (prints
//! it, opens it where a browser is at hand) and `pdctl export grafana`.

use super::common::{ClusterArgs, read_plan, running};
use crate::plan::Plan;
use crate::supervisor::StateDir;
use crate::vocab::Role;
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// The title the page carries, which tells it from another program on its port.
const PAGE_MARK: &str = "<title>pdctl dashboard</title>";

/// Starts the page's server on `rt`, on the head of a plan whose `[dashboard]` is on.
/// Returns the line to show about it (None: no dashboard here). A port that cannot be
/// bound leaves the cluster running without the page, and says why.
pub fn start(
    rt: &tokio::runtime::Runtime,
    plan: &Plan,
    node: &str,
    state: &StateDir,
    client_key: Option<&crate::control::auth::ClientKey>,
    engine_key: Option<&crate::control::auth::EngineKey>,
) -> Option<String> {
    let d = &plan.dashboard;
    if !d.enabled || node != plan.head_node {
        return None;
    }
    if let Some(why) = crate::dashboard::refusal(d, client_key.is_some()) {
        return Some(format!("dashboard not served: {why}"));
    }
    let listener = match std::net::TcpListener::bind((d.bind.as_str(), d.port)) {
        Ok(l) => l,
        Err(e) => {
            return Some(format!(
                "dashboard not served: cannot listen on {}:{}: {e} (set [dashboard] port to a free one, or enabled = false)",
                d.bind, d.port
            ));
        }
    };
    let proxy_log = plan
        .by_role(Role::Proxy)
        .find(|s| s.node == node)
        .map(|s| state.log_path(&s.name));
    let watch = crate::dashboard::Watch {
        socket: state.socket_path(),
        proxy_log,
        nodes: plan.nodes.clone(),
        key: (!d.loopback_only()).then(|| client_key.map(|k| k.reveal().to_string())).flatten(),
        hidden: [client_key.map(|k| k.reveal()), engine_key.map(|k| k.reveal())]
            .into_iter()
            .flatten()
            .map(str::to_string)
            .collect(),
        cluster: plan.cluster.clone(),
        port: d.port,
        objectives: plan
            .rebalance
            .as_ref()
            .map(|r| serde_json::json!({"ttft_p90_ms": r.table.ttft_p90_ms, "itl_p90_ms": r.table.itl_p90_ms}))
            .unwrap_or_default(),
    };
    rt.spawn(async move {
        if let Err(e) = crate::dashboard::serve(listener, watch).await {
            tracing::warn!("the dashboard stopped serving: {e}");
        }
    });
    Some(format!(
        "dashboard at {} (`pdctl dashboard` opens it)",
        d.url()
    ))
}

/// The line about the dashboard of a running cluster: its address when it answers there,
/// else why not; None when the plan has none.
pub async fn line(plan: &Plan) -> Option<String> {
    let d = &plan.dashboard;
    if !d.enabled {
        return None;
    }
    let url = d.url();
    Some(match answers(&url, &plan.cluster).await {
        true => format!("dashboard at {url} (`pdctl dashboard` opens it)"),
        false => format!(
            "dashboard not answering at {url}: the supervisor's log says why (`pdctl logs` lists it)"
        ),
    })
}

/// Whether the page of cluster `cluster` answers at `url` (not another program, nor
/// another cluster's dashboard that took the port first).
async fn answers(url: &str, cluster: &str) -> bool {
    let Ok(client) = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(700))
        .build()
    else {
        return false;
    };
    match client.get(url).send().await {
        Ok(r) if r.status().is_success() => {
            let ours = r
                .headers()
                .get(crate::dashboard::CLUSTER_HEADER)
                .is_some_and(|v| v.as_bytes() == cluster.as_bytes());
            ours && r.text().await.is_ok_and(|t| t.contains(PAGE_MARK))
        }
        _ => false,
    }
}

/// `text` (a status table, whose heading names the proxy's address) with `line` after it
/// (not between the heading and the rows, which scripts read as the table).
pub fn after_table(text: &str, line: Option<&str>) -> String {
    match line {
        Some(l) => format!("{text}{l}\n"),
        None => text.to_string(),
    }
}

/// The line `up` in the foreground shows after its status table.
static FOREGROUND_LINE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Keeps the line for the foreground `up`'s healthy text.
pub fn keep_foreground_line(line: String) {
    let _ = FOREGROUND_LINE.set(line);
}

/// The line kept by [`keep_foreground_line`].
pub fn foreground_line() -> Option<&'static str> {
    FOREGROUND_LINE.get().map(String::as_str)
}

/// Arguments of `pdctl dashboard`.
#[derive(Debug, Args)]
pub struct DashboardArgs {
    /// Only print the address; do not open a browser.
    #[arg(long)]
    pub no_open: bool,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// `pdctl dashboard`: the running cluster's page address, opened where a browser is at
/// hand (a desktop session with `xdg-open`). Exit 1 when it does not answer.
pub fn run(a: DashboardArgs) -> anyhow::Result<ExitCode> {
    let found = running(&a.which.state_dir, a.which.cluster.as_deref(), "show")?;
    let plan = read_plan(&StateDir::new(&found.dir).plan_path())?;
    let d = &plan.dashboard;
    if !d.enabled {
        return Err(super::ExitError::usage(format!(
            "cluster {} has no dashboard: its topology's [dashboard] says enabled = false",
            found.cluster
        )));
    }
    let url = d.url();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    if !rt.block_on(answers(&url, &plan.cluster)) {
        eprintln!(
            "pdctl: the dashboard of cluster {} does not answer at {url}; the supervisor's log ({}) says why",
            found.cluster,
            StateDir::new(&found.dir).supervisor_log_path().display()
        );
        return Ok(ExitCode::from(1));
    }
    println!("{url}");
    if !d.loopback_only() {
        println!(
            "(bound beyond this machine: it asks for the cluster's client key, {})",
            crate::vocab::PROXY_CLIENT_KEY_VAR
        );
    }
    if !a.no_open {
        open_in_browser(&url);
    }
    Ok(ExitCode::SUCCESS)
}

/// Opens `url` with `xdg-open` in a desktop session; says so when there is none.
fn open_in_browser(url: &str) {
    let desktop = ["DISPLAY", "WAYLAND_DISPLAY"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()));
    let opener = crate::tools::find_program("xdg-open");
    match (desktop, opener) {
        (true, Some(program)) => {
            let spawned = std::process::Command::new(program)
                .arg(url)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn();
            if let Err(e) = spawned {
                eprintln!(
                    "pdctl: could not open a browser (xdg-open: {e}); open the address yourself"
                );
            }
        }
        _ => eprintln!(
            "pdctl: no desktop browser here (no DISPLAY or xdg-open): open the address yourself"
        ),
    }
}

/// Arguments of `pdctl export grafana`.
#[derive(Debug, Args)]
pub struct GrafanaArgs {
    /// Directory to write `pdctl-grafana-dashboard.json` and `prometheus-scrape.yml` into.
    #[arg(short = 'o', long = "output", default_value = ".")]
    pub output: PathBuf,
    /// For a dashboard bound beyond loopback: the file Prometheus reads the client key
    /// from (written into the supervisor job's `authorization`).
    #[arg(long, value_name = "FILE")]
    pub key_file: Option<String>,
    #[command(flatten)]
    pub which: ClusterArgs,
}

/// `pdctl export grafana`: the running cluster's Grafana dashboard and scrape config.
pub fn export_grafana(a: GrafanaArgs) -> anyhow::Result<ExitCode> {
    let found = running(&a.which.state_dir, a.which.cluster.as_deref(), "export")?;
    let plan = read_plan(&StateDir::new(&found.dir).plan_path())?;
    std::fs::create_dir_all(&a.output)
        .with_context(|| format!("-o {}: cannot create the directory", a.output.display()))?;
    let dashboard = crate::dashboard::grafana::dashboard(&plan);
    let json_path = a.output.join("pdctl-grafana-dashboard.json");
    let text = serde_json::to_string_pretty(&dashboard).expect("json");
    std::fs::write(&json_path, text + "\n")
        .with_context(|| format!("writing {}", json_path.display()))?;
    let yml_path = a.output.join("prometheus-scrape.yml");
    let key_file = match (&a.key_file, plan.dashboard.loopback_only()) {
        (Some(f), _) => Some(f.as_str()),
        (None, false) if plan.dashboard.enabled => {
            return Err(super::ExitError::usage(format!(
                "cluster {}'s dashboard is bound beyond loopback ({}), so its /metrics asks for the client key: give --key-file FILE, a file Prometheus can read holding the key ({})",
                plan.cluster,
                plan.dashboard.bind,
                crate::vocab::PROXY_CLIENT_KEY_VAR
            )));
        }
        (None, _) => None,
    };
    std::fs::write(
        &yml_path,
        crate::dashboard::grafana::scrape_config(&plan, key_file),
    )
    .with_context(|| format!("writing {}", yml_path.display()))?;
    println!("{}", json_path.display());
    println!("{}", yml_path.display());
    eprintln!("pdctl: docs/observability.md says how to load them into Prometheus and Grafana");
    Ok(ExitCode::SUCCESS)
}
