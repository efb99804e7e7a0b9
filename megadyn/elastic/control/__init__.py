"""The controller at the step boundary: the control channel (the store of requests and epochs),
its records, drains, the controller, its leader's decisions and its side of a failure's
recovery, the trainer protocol it needs, and the events it reports."""
