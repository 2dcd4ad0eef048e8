"""What tests of every tier share: sample objects, cases, strategies and waiting."""
