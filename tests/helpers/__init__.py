"""What the tests share: the process harness (dist, dist_pool), models, comparisons (util), and the cases
several test files train (cases, sharded_training). Test files import from here, never from each other."""
