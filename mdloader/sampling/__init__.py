"""Which frames form each batch: batch-size rules, system probabilities, the pure frame order
and system stream, the samplers, and the state protocol that resumes them."""
