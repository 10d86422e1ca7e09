//! The drive locks: which transfers a task of this process is driving right now. Within a
//! process one task at a time drives a transfer (two drivers under one owner would share a
//! lease; see the `driving` field of [`Driver`]), and the sweeper leaves alone
//! what a task of its own process drives.

use std::sync::Arc;

use super::Driver;
use crate::domain::TransferId;

impl Driver {
    /// The per-transfer lock that makes this process drive a transfer in one task only.
    pub(crate) fn drive_lock(&self, id: TransferId) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.driving.lock().unwrap_or_else(|e| e.into_inner());
        // Forget locks nobody holds or waits for, so the map stays as small as the work.
        map.retain(|_, lock| Arc::strong_count(lock) > 1);
        map.entry(id).or_default().clone()
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
