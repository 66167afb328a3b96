"""What nodes publish and read in the DHT, and how a joiner finds its run (run ids are
``wire.run_id``)::

run_configs   run configurations signed by the run's creator (bounded JSON)
run_info      RUN_INFO: a joiner asks the peer it was given which run it trains
nodes         per-node records (step, fragment versions, state), vouches, donors
declarations  a member's signed word that it is in round (p, k), with its prior
metrics       per-node metrics records for the dashboard
"""
