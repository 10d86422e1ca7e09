//! The drive locks: which transfers a task of this process is driving right now. Within a
//! process one task at a time drives a transfer (two drivers under one owner would share a
//! lease; see the `driving` field of [`Driver`]), and the sweeper leaves alone
//! what a task of its own process drives.

use std::sync::Arc;

use super::Driver;
use crate::domain::TransferId;

/// A transfer's drive lock, held (see [`Driver::lock_drive`]).
pub(crate) type Driving = tokio::sync::OwnedMutexGuard<()>;

impl Driver {
    /// The per-transfer lock that makes this process drive a transfer in one task only.
    pub(crate) fn drive_lock(&self, id: TransferId) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.driving.lock().unwrap_or_else(|e| e.into_inner());
        // Forget locks nobody holds or waits for, so the map stays as small as the work.
        map.retain(|_, lock| Arc::strong_count(lock) > 1);
        map.entry(id).or_default().clone()
    }

    /// Takes the drive lock of `id`: while the guard lives, no other task of this process
    /// drives the transfer. Under a test's scheduler (`failpoints::install_hook`), a task
    /// that finds it taken parks at `wait_drive` and tries again each time it is let go,
    /// instead of blocking where the scheduler cannot see it: the holder is another task of
    /// this process, which goes on only when the scheduler lets it.
    pub(crate) async fn lock_drive(&self, id: TransferId) -> Driving {
        let lock = self.drive_lock(id);
        #[cfg(feature = "failpoints")]
        while crate::failpoints::hooked(self.instance_id()) {
            match lock.clone().try_lock_owned() {
                Ok(driving) => return driving,
                Err(_) => failpoint!(self, WaitDrive),
            }
        }
        lock.lock_owned().await
    }

    /// Lets go of `driving`, as the end of a run does (under a test's scheduler, a task
    /// parked at `wait_drive` hears of it at `after_drive`): for a request that took the
    /// lock before its insert and found the transfer not its own to drive.
    pub(crate) async fn let_go(&self, driving: Driving) {
        drop(driving);
        // Another task of this process may drive the transfer now.
        failpoint!(self, AfterDrive);
    }

    /// Whether a task of this process is driving `id` right now. The sweeper leaves such
    /// a transfer alone: claiming it would renew the lease of a task that may be stuck,
    /// and keep every other instance from taking it over.
    pub(crate) fn is_driving(&self, id: TransferId) -> bool {
        let map = self.driving.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&id).is_some_and(|lock| Arc::strong_count(lock) > 1)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::service::tests::offline_service;

    /// The drive locks are as many as the transfers being driven: a lock that no task
    /// holds or waits for is forgotten at the next lookup, so the map does not keep one
    /// entry for every transfer the process ever ran.
    #[tokio::test]
    async fn a_drive_lock_nobody_holds_is_forgotten() {
        let service = offline_service(Duration::from_secs(1)).await;
        let (done, driven) = (
            crate::store::new_transfer_id(),
            crate::store::new_transfer_id(),
        );
        drop(service.driver().drive_lock(done));
        let lock = service.driver().drive_lock(driven);
        let _guard = lock.lock().await;
        assert!(service.driver().is_driving(driven));
        assert!(!service.driver().is_driving(done));
        let map = service.driver().driving.lock().unwrap();
        assert_eq!(
            map.keys().collect::<Vec<_>>(),
            [&driven],
            "only the lock in use"
        );
    }
}
