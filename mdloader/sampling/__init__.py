"""Which frames form each batch: batch-size rules, system probabilities, the pure frame order
and system stream, the samplers (training, and exactly-once validation), and the state protocol
that resumes them on the same or on another number of ranks."""
