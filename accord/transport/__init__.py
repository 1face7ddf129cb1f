"""Links between the ranks of one group."""
