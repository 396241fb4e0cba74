"""Who may take part: enrollment, broker credentials and ACLs, the fleet's membership."""
