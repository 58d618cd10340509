//! kube-apiserver's audit log, for counting requests by who sent them and how: a policy of a few
//! rules (everything else recorded at level None), one JSON line per request in a directory of
//! its own, removed on drop. `apiserver_request_total` cannot tell a node's lists from the API
//! server's own controllers', nor show a request's parameters, and has no non-resource paths
//! such as `GET /version`.

use std::path::PathBuf;

use anyhow::Context;

pub struct Audit {
    dir: PathBuf,
}

impl Audit {
    /// `rules`: the policy's rules as YAML list items (`- level: Metadata\n  verbs: [list]`);
    /// a final `- level: None` is added.
    pub fn new(rules: &str) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("{}-{}-audit", crate::PREFIX, crate::unique_id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let policy = format!("apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n{rules}\n- level: None\n");
        std::fs::write(dir.join("policy.yaml"), policy)?;
        Ok(Self { dir })
    }

    /// kube-apiserver's flags for it (blocking: a request is in the log once it is answered).
    pub fn apiserver_args(&self) -> Vec<String> {
        vec![
            format!("--audit-policy-file={}", self.dir.join("policy.yaml").display()),
            format!("--audit-log-path={}", self.log().display()),
            "--audit-log-mode=blocking".into(),
        ]
    }

    fn log(&self) -> PathBuf {
        self.dir.join("audit.log")
    }

    /// The raw lines recorded so far, every kube-apiserver process included.
    pub fn lines(&self) -> anyhow::Result<Vec<String>> {
        match std::fs::read_to_string(self.log()) {
            Ok(text) => Ok(text.lines().map(str::to_owned).collect()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(error) => Err(error).with_context(|| format!("reading {}", self.log().display())),
        }
    }

    /// The events recorded after the first `skip`, parsed.
    pub fn events_after(&self, skip: usize) -> anyhow::Result<Vec<serde_json::Value>> {
        self.lines()?
            .iter()
            .skip(skip)
            .map(|line| serde_json::from_str(line).with_context(|| format!("an audit line that is not JSON: {line}")))
            .collect()
    }
}

impl Drop for Audit {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
