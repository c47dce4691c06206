"""Pipeline schedules as data, and the simulator that puts one on a clock.
"""
