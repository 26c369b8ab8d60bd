"""Filter / score / pick: protocols, profiles and the scheduler that runs them."""
