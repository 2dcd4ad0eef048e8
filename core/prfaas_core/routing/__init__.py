"""The router's decisions, pure: the routing policy, the prefix index, worker selection and the live link estimate."""
