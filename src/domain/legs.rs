//! A multi-leg transfer: several legs that move together or not at all (a payment, its
//! fee and its split). What the protocol moves is not the legs but each account's net
//! change over all of them, its [`Party`]: every account changes once (see
//! `docs/legs.md`).

use super::{AccountId, Amount, DeploymentName, MAX_MONEY};

/// Legs in one transfer, at least and at most.
pub const LEGS: std::ops::RangeInclusive<usize> = 2..=16;

/// Distinct accounts one multi-leg transfer may touch, at most: two a leg, so the bound
/// on the legs keeps it.
pub const MAX_LEG_ACCOUNTS: usize = 2 * *LEGS.end();

/// One leg as sent: `amount` from `source` to `destination`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leg {
    pub source: AccountId,
    pub destination: AccountId,
    pub amount: Amount,
}

/// One account of a multi-leg transfer: the sum of what its legs pay into it less what
/// they take out of it, and the deployment that keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Party {
    pub account: AccountId,
    /// Minor units: negative when the account pays more than it receives, then judged
    /// against its available balance; zero or positive otherwise, then against
    /// `MAX_MONEY`.
    pub net: i64,
    pub deployment: DeploymentName,
}

impl Party {
    /// Whether the account pays (its net change is a debit): its step then takes money
    /// out before the commit point, else it only makes room for what comes in, and the
    /// money lands after it.
    pub fn pays(&self) -> bool {
        self.net < 0
    }
}

/// Why a list of legs is not a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LegsError {
    /// Fewer than 2 or more than 16 legs.
    Count(usize),
    /// The leg at this index (from 0) pays its own account.
    SameAccount(usize),
    /// The legs together move more than `MAX_MONEY`: their sum is not an amount.
    Total,
    /// Every account gets back what it pays: no money moves.
    MovesNothing,
}

impl std::fmt::Display for LegsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (min, max) = (LEGS.start(), LEGS.end());
        match self {
            LegsError::Count(n) => write!(f, "must hold {min} to {max} legs, not {n}"),
            LegsError::SameAccount(i) => {
                write!(
                    f,
                    "leg {i}: source and destination must be different accounts"
                )
            }
            LegsError::Total => write!(f, "the legs' amounts must add up to at most {MAX_MONEY}"),
            LegsError::MovesNothing => {
                write!(f, "must move money: every account gets back what it pays")
            }
        }
    }
}

/// The legs of a multi-leg transfer, valid by construction, with their parties: each
/// account once, in the order it first appears in the legs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Legs {
    legs: Vec<Leg>,
    parties: Vec<Party>,
    moved: Amount,
}

impl Legs {
    /// The legs as sent, checked: 2 to 16 of them (so at most [`MAX_LEG_ACCOUNTS`]
    /// accounts), none paying its own account, a sum that is itself an amount, and some
    /// money moved. Every party is placed on the default deployment until
    /// [`Legs::placed`] says where it lives.
    pub fn new(legs: Vec<Leg>) -> Result<Legs, LegsError> {
        if !LEGS.contains(&legs.len()) {
            return Err(LegsError::Count(legs.len()));
        }
        if let Some(i) = legs.iter().position(|l| l.source == l.destination) {
            return Err(LegsError::SameAccount(i));
        }
        let mut parties: Vec<Party> = Vec::new();
        let mut add = |account: &AccountId, change: i64| match parties
            .iter_mut()
            .find(|p| p.account == *account)
        {
            Some(party) => party.net += change,
            None => parties.push(Party {
                account: account.clone(),
                net: change,
                deployment: DeploymentName::default(),
            }),
        };
        let mut total: i64 = 0;
        for leg in &legs {
            // At most 16 amounts of at most 2^53 - 1 each: no i64 overflows.
            let value = leg.amount.minor_units();
            total += value;
            add(&leg.source, -value);
            add(&leg.destination, value);
        }
        debug_assert!(parties.len() <= MAX_LEG_ACCOUNTS);
        Amount::parse(total).map_err(|_| LegsError::Total)?;
        // At most the sum of the legs, so an amount unless it is zero.
        let paid: i64 = parties.iter().filter(|p| p.pays()).map(|p| -p.net).sum();
        let moved = Amount::parse(paid).map_err(|_| LegsError::MovesNothing)?;
        Ok(Legs {
            legs,
            parties,
            moved,
        })
    }

    /// The same legs, each party on the deployment `place` names.
    pub fn placed(mut self, place: impl Fn(&AccountId) -> DeploymentName) -> Legs {
        for party in &mut self.parties {
            party.deployment = place(&party.account);
        }
        self
    }

    pub fn legs(&self) -> &[Leg] {
        &self.legs
    }

    pub fn parties(&self) -> &[Party] {
        &self.parties
    }

    /// The money that changes hands: what the paying parties pay, which is what the
    /// receiving parties receive (a buyer paying 10000 that a seller passes on in part
    /// moves 10000, whatever the legs add up to). The transfer's `amount`.
    pub fn moved(&self) -> Amount {
        self.moved
    }

    /// The party of `account`, if the legs touch it.
    pub fn party(&self, account: &AccountId) -> Option<&Party> {
        self.parties.iter().find(|p| p.account == *account)
    }

    /// The legs that undo these: each one the other way round, its parties where they
    /// are (a reversal's), in the order they first appear in the new legs.
    pub fn reversed(&self) -> Legs {
        let legs = self
            .legs
            .iter()
            .map(|l| Leg {
                source: l.destination.clone(),
                destination: l.source.clone(),
                amount: l.amount,
            })
            .collect();
        let reversed = Legs::new(legs)
            .unwrap_or_else(|e| panic!("bug: legs reversed are no longer legs: {e}"));
        reversed.placed(|account| {
            self.party(account)
                .map(|p| p.deployment.clone())
                .unwrap_or_default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leg(source: &str, destination: &str, amount: i64) -> Leg {
        Leg {
            source: AccountId::parse(source).unwrap(),
            destination: AccountId::parse(destination).unwrap(),
            amount: Amount::parse(amount).unwrap(),
        }
    }

    fn nets(legs: &Legs) -> Vec<(&str, i64)> {
        legs.parties()
            .iter()
            .map(|p| (p.account.as_str(), p.net))
            .collect()
    }

    #[test]
    fn each_account_is_one_party_with_its_net_change_in_the_order_it_first_appears() {
        let legs = Legs::new(vec![
            leg("buyer", "seller", 10_000),
            leg("seller", "platform", 300),
            leg("seller", "tax", 1_900),
        ])
        .unwrap();
        assert_eq!(
            nets(&legs),
            vec![
                ("buyer", -10_000),
                ("seller", 7_800),
                ("platform", 300),
                ("tax", 1_900)
            ]
        );
        // What the buyer pays, which is what the others receive; not the legs' sum.
        assert_eq!(legs.moved().minor_units(), 10_000);
        assert_eq!(legs.parties().iter().map(|p| p.net).sum::<i64>(), 0);
        assert!(
            legs.party(&AccountId::parse("buyer").unwrap())
                .unwrap()
                .pays()
        );
        assert!(
            !legs
                .party(&AccountId::parse("tax").unwrap())
                .unwrap()
                .pays()
        );
    }

    /// A pays B and B pays C as much: B's net is zero, and B is still a party (it is
    /// touched, and must exist).
    #[test]
    fn an_account_that_receives_what_it_pays_is_a_party_with_no_net_change() {
        let legs = Legs::new(vec![leg("a", "b", 100), leg("b", "c", 100)]).unwrap();
        assert_eq!(nets(&legs), vec![("a", -100), ("b", 0), ("c", 100)]);
        assert!(!legs.parties()[1].pays());
    }

    #[test]
    fn the_number_of_legs_is_two_to_sixteen() {
        assert_eq!(Legs::new(vec![leg("a", "b", 1)]), Err(LegsError::Count(1)));
        assert_eq!(Legs::new(vec![]), Err(LegsError::Count(0)));
        let sixteen: Vec<Leg> = (0..16).map(|i| leg("a", &format!("b{i}"), 1)).collect();
        assert!(Legs::new(sixteen.clone()).is_ok());
        let mut seventeen = sixteen;
        seventeen.push(leg("a", "c", 1));
        assert_eq!(Legs::new(seventeen), Err(LegsError::Count(17)));
    }

    #[test]
    fn sixteen_legs_between_distinct_accounts_make_thirty_two_parties() {
        let legs: Vec<Leg> = (0..16)
            .map(|i| leg(&format!("s{i}"), &format!("d{i}"), 1))
            .collect();
        assert_eq!(
            Legs::new(legs).map(|l| l.parties().len()),
            Ok(MAX_LEG_ACCOUNTS)
        );
    }

    #[test]
    fn a_leg_that_pays_its_own_account_is_refused_by_its_index() {
        assert_eq!(
            Legs::new(vec![leg("a", "b", 1), leg("c", "c", 1)]),
            Err(LegsError::SameAccount(1))
        );
    }

    #[test]
    fn the_sum_of_the_legs_must_be_an_amount() {
        let max = MAX_MONEY;
        assert!(Legs::new(vec![leg("a", "b", max - 1), leg("c", "d", 1)]).is_ok());
        assert_eq!(
            Legs::new(vec![leg("a", "b", max), leg("c", "d", 1)]),
            Err(LegsError::Total)
        );
    }

    #[test]
    fn legs_that_move_no_money_are_refused() {
        assert_eq!(
            Legs::new(vec![leg("a", "b", 100), leg("b", "a", 100)]),
            Err(LegsError::MovesNothing)
        );
    }

    #[test]
    fn the_reversal_swaps_every_leg_and_every_net() {
        let legs = Legs::new(vec![leg("a", "b", 100), leg("a", "c", 50)]).unwrap();
        let back = legs.reversed();
        assert_eq!(nets(&back), vec![("b", -100), ("a", 150), ("c", -50)]);
        // As if sent so: its parties are those the service would make of its legs.
        assert_eq!(Legs::new(back.legs().to_vec()).unwrap(), back);
        assert_eq!(back.legs()[1], leg("c", "a", 50));
        assert_eq!(back.moved(), legs.moved());
    }
}
