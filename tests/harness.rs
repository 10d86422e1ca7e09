//! The test harness itself: the database folder of a test process goes with it.
//!
//! Every test binary starts one database daemon in a temporary folder (about 130 MB each).
//! Those folders were never removed, and a machine that ran the suite a few hundred
//! times ran out of disk (CI failed with "No space left on device"). These run this very
//! binary again as a child process that starts the shared daemon, and look at the
//! folder after the child has gone.

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// Not a test of its own: the child process of the tests below (run with `--ignored`).
/// Starts the process-wide daemon, prints its folder, and waits for a line on stdin
/// (or for its end) before it exits normally.
#[test]
#[ignore = "the child process of the harness tests"]
fn child_with_the_shared_daemon() {
    support::database_uri();
    let folder = support::shared_daemon_folder().expect("the shared daemon was started");
    assert!(folder.is_dir(), "{folder:?}");
    println!("FOLDER={}", folder.display());
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// Starts the child; returns it and the folder of its daemon.
fn start_child() -> (std::process::Child, PathBuf) {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_with_the_shared_daemon",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        // The child starts its own daemon, whatever this process uses.
        .env_remove("MONGODB_URI")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the child");
    // Read the child's output to its end on a thread of its own, so that the child never
    // writes into a closed pipe (and fails for it) after it has named its folder.
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            // The harness prints the test's name first, on the same line.
            if let Some((_, folder)) = line.split_once("FOLDER=") {
                let _ = tx.send(PathBuf::from(folder));
            }
        }
    });
    match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(folder) => (child, folder),
        Err(_) => panic!("the child never named its folder: {:?}", child.try_wait()),
    }
}

#[test]
fn a_test_process_that_exits_removes_its_database_folder() {
    let (mut child, folder) = start_child();
    assert!(folder.is_dir(), "{folder:?} exists while the child runs");
    drop(child.stdin.take()); // the child exits normally
    assert!(child.wait().unwrap().success());
    assert!(!folder.exists(), "{folder:?} was left behind");
}

#[test]
fn the_folder_of_a_killed_test_process_is_removed_by_the_next_one() {
    let (mut killed, left_behind) = start_child();
    killed.kill().unwrap();
    killed.wait().unwrap();
    assert!(
        left_behind.is_dir(),
        "a killed process cannot remove its folder"
    );

    let (mut next, its_own) = start_child();
    assert!(
        !left_behind.exists(),
        "{left_behind:?} outlived its process"
    );
    drop(next.stdin.take());
    assert!(next.wait().unwrap().success());
    assert!(!its_own.exists(), "{its_own:?} was left behind");
}
